"""Who pulls from whom (pure): a group's sources, as the builder collects them per engine rank, counted as the
planner's pulls (``kvmove.sync.planning.schedule``: one per engine rank, kind and serving trainer rank)."""

from __future__ import annotations

import numpy as np

Source = tuple[int, tuple[object, ...]]
"""(engine rank, key): ``("shard", holders)`` for a direct read, ``("from", owner, holders, name)`` for a packed one."""


def count_pulls(sources: list[set[Source]], pulls: np.ndarray, direct: np.ndarray, calls: np.ndarray) -> None:
    """Add each group's pulls per engine rank (``pulls``; direct ones also to ``direct``) and the calls each
    trainer rank serves (``calls``, a packed pull's call shared by the ranks able to serve it)."""
    for g, pairs in enumerate(sources):
        for k, kind, ranks in by_rank(pairs):
            pulls[g, k] += 1
            if kind == "shard":
                direct[g, k] += 1
            else:
                calls[g, list(ranks)] += 1.0 / len(ranks)


def by_rank(pairs: set[Source]) -> list[tuple[int, str, tuple[int, ...]]]:
    """A group's pulls, as (engine rank, kind, serving trainer ranks). The planner buckets an engine rank's direct
    reads by the trainer rank serving them (``kvmove.sync.planning.schedule``) and its router spreads a slice
    several ranks hold (replicated over DP or TP) over them by bytes, so each engine rank reads once from every
    trainer rank holding any of its direct slices. A packed source is one pull from the ranks able to serve it."""
    served: dict[int, set[int]] = {}
    out: list[tuple[int, str, tuple[int, ...]]] = []
    for k, key in pairs:
        if key[0] == "shard":
            served.setdefault(k, set()).update(key[1])  # type: ignore[arg-type]
        else:
            out.append((k, "from", tuple(key[2])))  # type: ignore[arg-type]
    return out + [(k, "shard", (t,)) for k, ranks in served.items() for t in sorted(ranks)]
