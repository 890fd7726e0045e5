"""Source mapping: which trainer rank serves each region of each engine rank, balanced by bytes.

Greedy longest-processing-time: regions with a single possible source are fixed first, the others go
largest first to the least-loaded trainer rank that holds them (ties to the lowest rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from kvmove.layout import EngineLayout
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.ownership import Owners
from kvmove.sync.planning.plan import Box, ShardingPlan
from kvmove.sync.strategies import Strategy


class SourceMap(NamedTuple):
    """``sources[e][i]`` is the trainer rank serving region ``i`` of engine rank ``e``'s plan."""

    strategy: str
    sources: tuple[tuple[int, ...], ...]
    bytes_per_trainer: tuple[int, ...]
    bytes_per_engine: tuple[int, ...]

    @property
    def balance(self) -> float:
        """Bytes served by the busiest trainer rank over the mean (1.0 is perfect)."""
        total = sum(self.bytes_per_trainer)
        return max(self.bytes_per_trainer) * len(self.bytes_per_trainer) / total if total else 1.0

    def served_by(self, trainer_rank: int) -> list[tuple[int, int]]:
        """(engine rank, region index) pairs that ``trainer_rank`` serves."""
        return [(e, i) for e, srcs in enumerate(self.sources) for i, t in enumerate(srcs) if t == trainer_rank]


def route(
    plans: Sequence[ShardingPlan],
    layout: EngineLayout,
    ownership: Owners,
    strategy: Strategy,
    direct: DirectPlanner | None = None,
) -> SourceMap:
    """Assign every region of every engine rank (all replicas) to one trainer rank holding it.

    With ``direct`` (strategies that allow direct pulls), a region goes to a rank whose *raw* shard contains it
    when there is one, so it can be read from that rank's arena without a gather.
    """
    cands: dict[tuple[str, Box], tuple[int, ...]] = {}
    jobs: list[tuple[int, int, int, tuple[int, ...]]] = []  # (-bytes, engine rank, region index, candidates)
    for e in range(layout.world):
        plan = plans[layout.coord(e).local]
        for i, region in enumerate(plan.regions):
            c = cands.get((region.hf_name, region.box))
            if c is None:
                c = ownership.holders(region.hf_name, strategy.scope)
                if direct is not None:
                    c = direct.shard_holders(region, c) or c
                cands[(region.hf_name, region.box)] = c
            jobs.append((-region.nbytes, e, i, c))
    jobs.sort(key=lambda j: (len(j[3]) > 1, j[0], j[1], j[2]))
    loads = [0] * ownership.world
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    sources = [[0] * len(plans[layout.coord(e).local].regions) for e in range(layout.world)]
    for neg_bytes, e, i, c in jobs:
        rank = c[0] if len(c) == 1 else _least_loaded(heaps, loads, c)
        loads[rank] -= neg_bytes
        sources[e][i] = rank
    per_engine = tuple(plans[layout.coord(e).local].nbytes for e in range(layout.world))
    return SourceMap(strategy.name, tuple(map(tuple, sources)), tuple(loads), per_engine)


def _least_loaded(heaps: dict[tuple[int, ...], list[tuple[int, int]]], loads: list[int], cands: tuple[int, ...]) -> int:
    heap = heaps.get(cands)
    if heap is None:
        heap = heaps[cands] = [(loads[r], r) for r in cands]
        heapq.heapify(heap)
    while True:  # entries go stale when another candidate set raised a shared rank's load
        load, rank = heap[0]
        if load == loads[rank]:
            return rank
        heapq.heapreplace(heap, (loads[rank], rank))
