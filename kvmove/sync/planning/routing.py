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
from typing import Any, NamedTuple

import numpy as np

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


class _Jobs(NamedTuple):
    """Every job of every engine rank (one per entry, or per piece of an entry read in pieces), as parallel arrays
    in routing order; candidate sets are interned (``sets[cand[j]]``), pieces listed once (``piece[j]``: index into
    ``pieces``, -1 for a whole entry)."""

    neg_bytes: np.ndarray
    engine: np.ndarray
    entry: np.ndarray
    cand: np.ndarray
    piece: np.ndarray
    sets: list[tuple[int, ...]]
    pieces: list[Region]


def route(
    plans: Sequence[ShardingPlan],
    layout: EngineLayout,
    ownership: Owners,
    strategy: Strategy,
    direct: DirectPlanner | None = None,
    devices: DeviceMap | None = None,
    shard_reads: bool | None = None,
    tensors: Sequence[TensorMeta] | None = None,
    memo: dict[Hashable, Any] | None = None,
) -> SourceMap:
    """Assign every entry of every engine rank (all replicas) to one trainer rank that may serve it (or, read in
    pieces, each piece to one rank holding its shard).

    With ``direct`` (strategies that allow direct pulls), a region goes to a rank whose *raw* shard contains it
    when there is one, so it can be read from that rank's arena without a gather; failing that, it is cut into
    pieces along the raw shards when every piece can be read directly. Quantized covers and their pieces are
    served from raw shards where that avoids a gather (kvmove.sync.planning.entries; ``shard_reads`` overrides
    whether they may be, default: where ``direct`` is planned); they are never cut into direct pieces.
    ``tensors``: the source's tensors (see ``entries.EntryPlanner``). ``memo``: entries (and their jobs) already
    planned for other strategies of the same plans, layout, ownership, direct planner and tensors (the caller's to
    keep per run); strategies that gather and read alike share them.
    """
    key = (strategy.scope, strategy.direct, shard_reads)
    entries = memo.get(key) if memo is not None else None
    if entries is None:
        entries = plan_entries(plans, ownership, strategy, direct, shard_reads, tensors)
        if memo is not None:
            memo[key] = entries
    counts = [len(entries[layout.coord(e).local].entries) for e in range(layout.world)]
    base = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    jobs = memo.get(("jobs", key)) if memo is not None else None
    if jobs is None:
        jobs = _jobs(entries, layout)
        if memo is not None:
            memo[("jobs", key)] = jobs
    loads = np.zeros(ownership.world, dtype=np.int64)
    sources = np.full(int(base[-1]), -1, dtype=np.int64)
    fixed = _fix_single(jobs, base, loads, sources)
    flat, starts = sources.tolist(), base.tolist()
    served = _serve(jobs, np.flatnonzero(~fixed), loads.tolist(), flat, starts, devices)
    per_engine = tuple(entries[layout.coord(e).local].nbytes for e in range(layout.world))
    split = {k: tuple(v) for k, v in served.pieces.items()}
    rows = tuple(tuple(flat[starts[e] : starts[e + 1]]) for e in range(layout.world))
    return SourceMap(strategy.name, rows, tuple(served.loads), per_engine, entries, split)


def _jobs(entries: Sequence[EntryPlan], layout: EngineLayout) -> _Jobs:
    """The jobs of every engine rank, sorted into routing order: those with one possible source first, then
    largest first (ties by engine rank, entry, then piece order). Each local rank's jobs are listed once and
    repeated for every replica."""
    sets = _Sets()
    pieces: list[Region] = []
    local: dict[int, np.ndarray] = {}
    for e in range(layout.world):
        lr = layout.coord(e).local
        if lr not in local:
            local[lr] = _local_jobs(entries[lr], sets, pieces)
    table = np.concatenate([_with_engine(local[layout.coord(e).local], e) for e in range(layout.world)])
    neg, eng, ent, cand, piece = table.T
    size = np.fromiter((len(c) for c in sets.ids), dtype=np.int64, count=len(sets.ids))
    order = np.lexsort((ent, eng, neg, size[cand] > 1))  # stable: an entry's pieces keep their order
    return _Jobs(neg[order], eng[order], ent[order], cand[order], piece[order], list(sets.ids), pieces)


class _Sets:
    """Candidate sets interned to ids (looked up by identity first: entries share their holders' tuples)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, ...], int] = {}
        self._by_object: dict[int, int] = {}

    def id(self, ranks: tuple[int, ...]) -> int:
        k = self._by_object.get(id(ranks))
        if k is None:
            k = self._by_object[id(ranks)] = self.ids.setdefault(ranks, len(self.ids))
        return k


def _local_jobs(plan: EntryPlan, sets: _Sets, pieces: list[Region]) -> np.ndarray:
    """``(n, 5)`` rows (-bytes, engine placeholder, entry, candidate set, piece) of one local rank's entries."""
    rows: list[tuple[int, int, int, int, int]] = []
    for i, entry in enumerate(plan.entries):
        if entry.pieces:
            for p in entry.pieces:
                rows.append((-p.region.nbytes, 0, i, sets.id(p.holders), len(pieces)))
                pieces.append(p.region)
        else:
            rows.append((-sum(entry.sizes), 0, i, sets.id(entry.holders), -1))
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def _with_engine(rows: np.ndarray, e: int) -> np.ndarray:
    out = rows.copy()
    out[:, 1] = e
    return out


def _fix_single(jobs: _Jobs, base: np.ndarray, loads: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """Jobs of whole entries with a single possible source, served by it (in bulk: they need no choice); returns
    which jobs were fixed."""
    first = np.fromiter((c[0] if c else -1 for c in jobs.sets), dtype=np.int64, count=len(jobs.sets))
    size = np.fromiter((len(c) for c in jobs.sets), dtype=np.int64, count=len(jobs.sets))
    fixed = (size[jobs.cand] == 1) & (jobs.piece < 0)
    ranks = first[jobs.cand[fixed]]
    np.add.at(loads, ranks, -jobs.neg_bytes[fixed])
    sources[base[jobs.engine[fixed]] + jobs.entry[fixed]] = ranks  # one whole-entry job per entry
    return fixed


class _Served(NamedTuple):
    """What the greedy loop leaves: each trainer rank's bytes, and the pieces of entries read in pieces."""

    loads: list[int]
    pieces: dict[tuple[int, int], list[tuple[int, Region]]]


def _serve(
    jobs: _Jobs, todo: np.ndarray, loads: list[int], sources: list[int], base: list[int], devices: DeviceMap | None
) -> _Served:
    """Greedy longest-processing-time over jobs ``todo`` (those that need a choice, and pieces), in routing order:
    each to the least-loaded candidate (ties to the lowest rank; with ``devices``, among those on the engine rank's
    own device where there are any). ``sources[base[e] + i]`` is set for entries not yet served (an entry read in
    pieces: its first piece's rank). One flat loop: Kimi K2 routes 386k jobs per strategy through it."""
    sets = list(jobs.sets)
    near: dict[tuple[int, int], int] = {}
    heaps: dict[int, list[tuple[int, int]]] = {}
    pieces: dict[tuple[int, int], list[tuple[int, Region]]] = {}
    columns = (jobs.neg_bytes, jobs.engine, jobs.entry, jobs.cand, jobs.piece)
    for nb, e, i, k, p in zip(*(c[todo].tolist() for c in columns), strict=True):
        if devices is not None:
            k = _on_device(sets, near, devices, e, k)
        c = sets[k]
        if len(c) == 1:
            rank = c[0]
        else:
            heap = heaps.get(k)
            if heap is None:
                heap = heaps[k] = [(loads[r], r) for r in c]
                heapq.heapify(heap)
            while True:  # entries go stale when another candidate set raised a shared rank's load
                load, rank = heap[0]
                if load == loads[rank]:
                    break
                heapq.heapreplace(heap, (loads[rank], rank))
        loads[rank] -= nb
        if p >= 0:
            pieces.setdefault((e, i), []).append((rank, jobs.pieces[p]))
        if sources[base[e] + i] < 0:
            sources[base[e] + i] = rank
    return _Served(loads, pieces)


def _on_device(
    sets: list[tuple[int, ...]], near: dict[tuple[int, int], int], devices: DeviceMap, e: int, k: int
) -> int:
    """The id of candidate set ``k`` narrowed to those on engine rank ``e``'s own device, where there are any."""
    found = near.get((e, k))
    if found is None:
        c = sets[k]
        narrowed = tuple(r for r in c if devices.is_local(e, r)) or c
        found = near[(e, k)] = sets.index(narrowed) if narrowed in sets else len(sets)
        if found == len(sets):
            sets.append(narrowed)
    return found
