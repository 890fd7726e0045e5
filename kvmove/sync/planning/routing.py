"""Source mapping: which trainer rank serves each entry of each engine rank, balanced by the bytes on the link.

Entries (kvmove.sync.planning.entries: a region as the loader reads it, or a quantized cover or a piece of one)
name the trainer ranks that may serve them. Greedy longest-processing-time: entries with a single possible
source are fixed first, the others go largest first to the least-loaded trainer rank that may serve them (ties
to the lowest rank). Where ranks share devices (``placement.DeviceMap``), a trainer rank on the engine rank's own
device is preferred whenever it may serve the entry: its bytes then never cross a link. A plain entry that direct
pulls read in pieces (its region spans several raw shards, ``direct.DirectPlanner.pieces``) is routed piece by
piece.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from kvmove.models.layout import EngineLayout
from kvmove.models.tensors import TensorMeta
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.entries import EntryPlan, plan_entries
from kvmove.sync.planning.ownership import Owners
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.plan import Region, ShardingPlan
from kvmove.sync.strategies import Strategy


class SourceMap(NamedTuple):
    """``sources[e][i]`` is the trainer rank serving entry ``i`` of engine rank ``e`` (``entries[local]``; a BF16
    engine's entry ``i`` is its plan's region ``i``). Bytes are what crosses the link. An entry read in pieces has
    ``pieces[(e, i)]``: (trainer rank, piece) each (its ``sources`` entry is the first piece's rank)."""

    strategy: str
    sources: tuple[tuple[int, ...], ...]
    bytes_per_trainer: tuple[int, ...]
    bytes_per_engine: tuple[int, ...]
    entries: tuple[EntryPlan, ...] = ()
    """Entries of each local engine rank's plan (index with ``layout.coord(e).local``)."""
    pieces: dict[tuple[int, int], tuple[tuple[int, Region], ...]] = {}  # noqa: RUF012 - never mutated

    @property
    def balance(self) -> float:
        """max / mean bytes per trainer rank (1.0 = perfect)."""
        total = sum(self.bytes_per_trainer)
        return max(self.bytes_per_trainer) * len(self.bytes_per_trainer) / total if total else 1.0

    def served_by(self, trainer_rank: int) -> list[tuple[int, int]]:
        """(engine rank, entry index) pairs that ``trainer_rank`` serves."""
        return [(e, i) for e, srcs in enumerate(self.sources) for i, t in enumerate(srcs) if t == trainer_rank]


class _Job(NamedTuple):
    neg_bytes: int
    engine: int
    entry: int
    candidates: tuple[int, ...]
    piece: Region | None = None


def route(
    plans: Sequence[ShardingPlan],
    layout: EngineLayout,
    ownership: Owners,
    strategy: Strategy,
    direct: DirectPlanner | None = None,
    devices: DeviceMap | None = None,
    shard_reads: bool | None = None,
    tensors: Sequence[TensorMeta] | None = None,
    memo: dict[Hashable, tuple[EntryPlan, ...]] | None = None,
) -> SourceMap:
    """Assign every entry of every engine rank (all replicas) to one trainer rank that may serve it (or, read in
    pieces, each piece to one rank holding its shard).

    With ``direct`` (strategies that allow direct pulls), a region goes to a rank whose *raw* shard contains it
    when there is one, so it can be read from that rank's arena without a gather; failing that, it is cut into
    pieces along the raw shards when every piece can be read directly. Quantized covers and their pieces are
    served from raw shards where that avoids a gather (kvmove.sync.planning.entries; ``shard_reads`` overrides
    whether they may be, default: where ``direct`` is planned); they are never cut into direct pieces.
    ``tensors``: the source's tensors (see ``entries.EntryPlanner``). ``memo``: entries already planned for other
    strategies of the same plans, ownership, direct planner and tensors (the caller's to keep per run); strategies
    that gather and read alike share them.
    """
    key = (strategy.scope, strategy.direct, shard_reads)
    entries = memo.get(key) if memo is not None else None
    if entries is None:
        entries = plan_entries(plans, ownership, strategy, direct, shard_reads, tensors)
        if memo is not None:
            memo[key] = entries
    jobs = _jobs(entries, layout)
    jobs.sort(key=lambda j: (len(j.candidates) > 1, j.neg_bytes, j.engine, j.entry))
    loads = [0] * ownership.world
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    sources = [[-1] * len(entries[layout.coord(e).local].entries) for e in range(layout.world)]
    pieces: dict[tuple[int, int], list[tuple[int, Region]]] = {}
    for job in jobs:
        c = job.candidates
        if devices is not None:
            c = tuple(r for r in c if devices.is_local(job.engine, r)) or c
        rank = c[0] if len(c) == 1 else _least_loaded(heaps, loads, c)
        loads[rank] -= job.neg_bytes
        if job.piece is not None:
            pieces.setdefault((job.engine, job.entry), []).append((rank, job.piece))
        if sources[job.engine][job.entry] < 0:
            sources[job.engine][job.entry] = rank
    per_engine = tuple(entries[layout.coord(e).local].nbytes for e in range(layout.world))
    split = {k: tuple(v) for k, v in pieces.items()}
    return SourceMap(strategy.name, tuple(map(tuple, sources)), tuple(loads), per_engine, entries, split)


def _jobs(entries: Sequence[EntryPlan], layout: EngineLayout) -> list[_Job]:
    """One job per entry (or per piece of an entry read in pieces) with the ranks that may serve it."""
    jobs: list[_Job] = []
    for e in range(layout.world):
        for i, entry in enumerate(entries[layout.coord(e).local].entries):
            if entry.pieces:
                jobs += [_Job(-p.region.nbytes, e, i, p.holders, p.region) for p in entry.pieces]
            else:
                jobs.append(_Job(-sum(entry.sizes), e, i, entry.holders))
    return jobs


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
