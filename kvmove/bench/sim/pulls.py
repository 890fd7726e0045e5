"""Who pulls from whom (pure): a group's sources, as the builder collects them per engine rank with the jobs (tensor
slices) each serves, counted as the planner's pulls (``kvmove.sync.planning.schedule``: one per engine rank, kind
and serving trainer rank)."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

Source = tuple[int, tuple[object, ...]]
"""(engine rank, key): ``("shard", holders)`` for a direct read, ``("from", owner, holders)`` for a packed one."""


def count_pulls(sources: list[Counter[Source]], pulls: np.ndarray, direct: np.ndarray, calls: np.ndarray) -> None:
    """Add each group's pulls per engine rank (``pulls``; direct ones also to ``direct``) and the calls each
    trainer rank serves (``calls``, spread over the ranks able to serve them)."""
    for g, jobs in enumerate(sources):
        for k, kind, n, ranks in by_rank(jobs):
            pulls[g, k] += n
            if kind == "shard":
                direct[g, k] += n
            else:
                calls[g, list(ranks)] += n / len(ranks)


def by_rank(jobs: Counter[Source]) -> list[tuple[int, str, int, tuple[int, ...]]]:
    """A group's pulls, as (engine rank, kind, pulls, the trainer ranks serving them). The planner buckets an
    engine rank's reads of each kind by the trainer rank serving them (``kvmove.sync.planning.schedule``), and its
    router spreads the jobs several ranks could serve (a slice replicated over DP or TP, a tensor several ranks
    hold once gathered) over them by bytes (``kvmove.sync.planning.routing``). So an engine rank pulls once from
    each rank that alone holds one of its slices, and its other jobs spread over the remaining holders, at most one
    pull per job."""
    served: dict[tuple[int, str], list[tuple[tuple[int, ...], int]]] = defaultdict(list)
    for (k, key), n in jobs.items():
        kind = "shard" if key[0] == "shard" else "from"
        served[(k, kind)].append((tuple(key[1] if kind == "shard" else key[2]), n))  # type: ignore[arg-type]
    out = []
    for (k, kind), held in served.items():
        forced = {r for ranks, _ in held if len(ranks) == 1 for r in ranks}
        every = {r for ranks, _ in held for r in ranks}
        flexible = sum(n for ranks, n in held if len(ranks) > 1)
        extra = min(flexible, len(every - forced))
        out.append((k, kind, len(forced) + extra, tuple(sorted(every))))
    return out
