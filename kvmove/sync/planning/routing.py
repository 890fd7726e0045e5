"""Source mapping: which trainer rank serves each region of each engine rank, balanced by bytes.

Greedy longest-processing-time: regions with a single possible source are fixed first, the others go
largest first to the least-loaded trainer rank that holds them (ties to the lowest rank). Where ranks share
devices (``placement.DeviceMap``), a trainer rank on the engine rank's own device is preferred whenever it holds
the region: its bytes then never cross a link. A region that direct pulls read in pieces (it spans several raw
shards, ``direct.DirectPlanner.pieces``) is routed piece by piece.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.layout import EngineLayout
from kvmove.sync.planning.direct import DirectPlanner, Piece
from kvmove.sync.planning.ownership import Owners
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.plan import Region, ShardingPlan
from kvmove.sync.strategies import Strategy


class SourceMap(NamedTuple):
    """``sources[e][i]`` is the trainer rank serving region ``i`` of engine rank ``e``'s plan; a region read in
    pieces has ``pieces[(e, i)]``: (trainer rank, piece) each (its ``sources`` entry is the first piece's rank)."""

    strategy: str
    sources: tuple[tuple[int, ...], ...]
    bytes_per_trainer: tuple[int, ...]
    bytes_per_engine: tuple[int, ...]
    pieces: dict[tuple[int, int], tuple[tuple[int, Region], ...]] = {}  # noqa: RUF012 - never mutated

    @property
    def balance(self) -> float:
        """Bytes served by the busiest trainer rank over the mean (1.0 is perfect)."""
        total = sum(self.bytes_per_trainer)
        return max(self.bytes_per_trainer) * len(self.bytes_per_trainer) / total if total else 1.0

    def served_by(self, trainer_rank: int) -> list[tuple[int, int]]:
        """(engine rank, region index) pairs that ``trainer_rank`` serves."""
        return [(e, i) for e, srcs in enumerate(self.sources) for i, t in enumerate(srcs) if t == trainer_rank]


class _Job(NamedTuple):
    neg_bytes: int
    engine: int
    region: int
    candidates: tuple[int, ...]
    piece: Region | None = None


def route(
    plans: Sequence[ShardingPlan],
    layout: EngineLayout,
    ownership: Owners,
    strategy: Strategy,
    direct: DirectPlanner | None = None,
    devices: DeviceMap | None = None,
) -> SourceMap:
    """Assign every region of every engine rank (all replicas) to one trainer rank holding it (or, read in pieces,
    each piece to one rank holding its shard).

    With ``direct`` (strategies that allow direct pulls), a region goes to a rank whose *raw* shard contains it
    when there is one, so it can be read from that rank's arena without a gather; failing that, it is cut into
    pieces along the raw shards when every piece can be read directly.
    """
    jobs = _jobs(plans, layout, ownership, strategy, direct)
    jobs.sort(key=lambda j: (len(j.candidates) > 1, j.neg_bytes, j.engine, j.region))
    loads = [0] * ownership.world
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    sources = [[-1] * len(plans[layout.coord(e).local].regions) for e in range(layout.world)]
    pieces: dict[tuple[int, int], list[tuple[int, Region]]] = {}
    for job in jobs:
        c = job.candidates
        if devices is not None:
            c = tuple(r for r in c if devices.is_local(job.engine, r)) or c
        rank = c[0] if len(c) == 1 else _least_loaded(heaps, loads, c)
        loads[rank] -= job.neg_bytes
        if job.piece is not None:
            pieces.setdefault((job.engine, job.region), []).append((rank, job.piece))
        if sources[job.engine][job.region] < 0:
            sources[job.engine][job.region] = rank
    per_engine = tuple(plans[layout.coord(e).local].nbytes for e in range(layout.world))
    split = {k: tuple(v) for k, v in pieces.items()}
    return SourceMap(strategy.name, tuple(map(tuple, sources)), tuple(loads), per_engine, split)


def _jobs(
    plans: Sequence[ShardingPlan],
    layout: EngineLayout,
    ownership: Owners,
    strategy: Strategy,
    direct: DirectPlanner | None,
) -> list[_Job]:
    """One job per region (or per piece of a region read in pieces) with the ranks that may serve it."""
    known: dict[tuple[int, int], tuple[int, ...] | list[Piece]] = {}  # replicas share plans: by (local rank, region)
    jobs: list[_Job] = []
    for e in range(layout.world):
        local = layout.coord(e).local
        plan = plans[local]
        dtypes = {p.name: p.dtype for p in plan.params}
        for i, region in enumerate(plan.regions):
            c = known.get((local, i))
            if c is None:
                c = known[(local, i)] = _candidates(region, dtypes[region.param], ownership, strategy, direct)
            if isinstance(c, tuple):
                jobs.append(_Job(-region.nbytes, e, i, c))
            else:
                jobs += [_Job(-p.region.nbytes, e, i, p.holders, p.region) for p in c]
    return jobs


def _candidates(
    region: Region, dtype: torch.dtype, ownership: Owners, strategy: Strategy, direct: DirectPlanner | None
) -> tuple[int, ...] | list[Piece]:
    """The ranks that may serve ``region`` whole, or its pieces when it is read in pieces."""
    holders = ownership.holders(region.hf_name, strategy.scope)
    if direct is None:
        return holders
    raw = direct.shard_holders(region, holders)
    if raw:
        return raw
    return direct.pieces(region, dtype) or holders


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
