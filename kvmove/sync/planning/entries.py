"""Plan entries (pure planning): what crosses the link for the regions of an engine rank's plan, and how.

A region a BF16 engine loads is served as its loader reads it: one ``plain`` entry. An FP8 engine's plan also
has regions of ``X.weight`` (e4m3fn) and ``X.weight_scale_inv`` (float32), which no trainer holds: each is one
part of quantizing a block-aligned BF16 *cover* of ``X.weight`` (kvmove.sync.planning.quantization). The planner
picks, per cover, where it is quantized; the name it picks is a transform of ``kvmove.sync.transforms.TRANSFORMS``
(what the trainer serves, what the engine does with the bytes):

- ``trainer``: one trainer rank holds every block of the cover whole - in its raw shard (read in place, no
  gather: strategies that read raw shards) or in the tensor its strategy gathers anyway - quantizes the cover
  and serves the FP8 weight and scale parts of its regions: only FP8 bytes and scales cross the link;
- ``engine``: a block of the cover straddles two raw shards, and the strategy reads raw shards: each shard's
  holder serves its BF16 *piece* of the cover as it holds it (no gather), and the engine quantizes the cover once
  every piece has landed.

Entries name the trainer ranks that may serve them (routing balances over these) and the bytes that cross the
link for them (what a sync's bytes and GB/s count). A plain entry whose region spans several raw shards may be
read directly in *pieces* (``DirectPlanner.pieces``: each piece from its shard's holders, routed piece by piece);
quantized covers and their ``engine`` pieces are never cut further: they are packed, not read directly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from kvmove.errors import PlanError
from kvmove.models.checkpoint import SCALE_SUFFIX
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.sync.planning.direct import DirectPlanner, Piece
from kvmove.sync.planning.ownership import Owners, Ownership
from kvmove.sync.planning.plan import Box, Region, ShardingPlan
from kvmove.sync.planning.quantization import QuantizedSource, is_quantized, quantized_source, straddling_share
from kvmove.sync.strategies import Strategy

PLAIN, TRAINER, ENGINE = "plain", "trainer", "engine"
"""Transform names the planner picks (keys of kvmove.sync.transforms.TRANSFORMS)."""


class Entry(NamedTuple):
    """One item an engine rank pulls: a box of a trainer tensor, and the transform applied on each side."""

    transform: str
    tensor: str
    """The trainer's HF tensor (BF16) the entry reads."""
    box: Box
    """The part of ``tensor`` the serving trainer rank reads (a region's box, a cover, or a piece of one)."""
    regions: tuple[int, ...]
    """Plan regions its parts land in, in part order (``engine`` pieces: none; their cover's regions land)."""
    sizes: tuple[int, ...]
    """Bytes of each part on the link, in slot order."""
    holders: tuple[int, ...]
    """Trainer ranks that may serve it."""
    shard: bool = False
    """Served from the serving rank's raw shard as it holds it (no gather), else from its materialized tensor."""
    cover: int = -1
    """``engine`` pieces: the index of their cover in ``EntryPlan.covers``."""
    pieces: tuple[Piece, ...] = ()
    """Plain entries read directly in pieces, one per raw shard its region spans (routed piece by piece)."""

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


class Cover(NamedTuple):
    """A block-aligned BF16 box an engine rank assembles from pulled pieces, quantizes, and lands in regions."""

    tensor: str
    box: Box
    regions: tuple[int, ...]
    parts: tuple[QuantizedSource, ...]
    """Per region: which part of the quantized cover it is, and its view there."""
    pieces: int
    dtype: torch.dtype = torch.bfloat16
    """The trainer tensor's dtype (what the pieces carry)."""


@dataclass(frozen=True)
class EntryPlan:
    """The entries of one engine rank's plan under one strategy (identical for every replica)."""

    entries: tuple[Entry, ...]
    covers: tuple[Cover, ...]
    quant: tuple[QuantizedSource | None, ...]
    """Per plan region: how it is made from BF16 (None: loaded as the trainer holds it)."""

    @cached_property
    def nbytes(self) -> int:
        """Bytes that cross the link for this rank."""
        return sum(e.nbytes for e in self.entries)

    def bytes_by_transform(self) -> dict[str, int]:
        """Bytes that cross the link for this rank, by transform name."""
        return dict(self._by_transform)

    @cached_property
    def _by_transform(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for e in self.entries:
            out[e.transform] += e.nbytes
        return dict(out)


class _Holders(NamedTuple):
    """Who may serve a region: the ranks whose raw shard holds it whole (``in_shard``), else those holding its
    tensor after the strategy's gather."""

    ranks: tuple[int, ...]
    in_shard: bool


class EntryPlanner:
    """Entries of engine plans under one strategy (caches what every rank's plan shares)."""

    def __init__(
        self,
        ownership: Owners,
        strategy: Strategy,
        direct: DirectPlanner | None = None,
        shard_reads: bool | None = None,
        tensors: Sequence[TensorMeta] | None = None,
    ) -> None:
        """``tensors``: the source's tensors (default: the direct planner's, else the HF checkpoint's of a
        rule-based :class:`Ownership`)."""
        self.ownership, self.scope = ownership, strategy.scope
        self.direct = direct if strategy.direct else None
        self.shard_reads = strategy.direct and (direct is not None if shard_reads is None else shard_reads)
        """Whether entries may be served from raw shards: strategies reading them, with arenas in place (default:
        where direct pulls are planned)."""
        self.metas = _metas(ownership, direct, tensors)
        self._holders: dict[tuple[str, Box], _Holders] = {}
        self._by_tensor: dict[str, tuple[int, ...]] = {}

    def plan(self, plan: ShardingPlan) -> EntryPlan:
        self._check_sources(plan.regions)
        metas = self.metas
        quant = tuple(
            quantized_source(r, metas[r.hf_name.removesuffix(SCALE_SUFFIX)].shape) if is_quantized(r) else None
            for r in plan.regions
        )
        by_cover: dict[tuple[str, Box], list[int]] = defaultdict(list)
        for i, q in enumerate(quant):
            if q is not None:
                by_cover[(q.weight, q.cover)].append(i)
        if self.direct is None and not by_cover:  # every region plain, served by whoever holds its tensor
            held = self._held
            return EntryPlan(tuple(held(r, i) for i, r in enumerate(plan.regions)), (), quant)
        entries: list[Entry] = []
        covers: list[Cover] = []
        dtypes = {p.name: p.dtype for p in plan.params}
        for i, (region, q) in enumerate(zip(plan.regions, quant, strict=True)):
            if q is None:
                entries.append(self._plain(region, i, dtypes[region.param], region.param in plan.staged))
            elif by_cover[(q.weight, q.cover)][0] == i:
                members = tuple(by_cover[(q.weight, q.cover)])
                entries += self._quantized(plan, quant, members, covers)
        return EntryPlan(tuple(entries), tuple(covers), quant)

    def _check_sources(self, regions: Sequence[Region]) -> None:
        """PlanError naming the first tensor (an FP8 scale: its weight) the regions read that the source lacks."""
        names = [r.hf_name.removesuffix(SCALE_SUFFIX) for r in regions]
        if not self.metas.keys() >= set(names):
            missing = next(n for n in names if n not in self.metas)
            raise PlanError(f"the source has no tensor {missing}")

    def _gathered(self, name: str) -> tuple[int, ...]:
        """The ranks holding tensor ``name`` whole once the strategy's gather ran (memoized per tensor)."""
        found = self._by_tensor.get(name)
        if found is None:
            found = self._by_tensor[name] = self.ownership.holders(name, self.scope)
        return found

    def _held(self, region: Region, i: int) -> Entry:
        """Region ``i`` served as it is by whoever holds its tensor once the strategy's gather ran."""
        return Entry(PLAIN, region.hf_name, region.box, (i,), (region.nbytes,), self._gathered(region.hf_name))

    def _plain(self, region: Region, i: int, param_dtype: torch.dtype, staged: bool = False) -> Entry:
        if self.direct is None:
            return self._held(region, i)
        key = (region.hf_name, region.box)
        found = self._holders.get(key)
        if found is None:
            gathered = self._gathered(region.hf_name)
            whole = self.direct.shard_holders(region, gathered)
            found = self._holders[key] = _Holders(whole or gathered, bool(whole))
        pieces: tuple[Piece, ...] = ()
        # a staged parameter is packed, never read directly (in pieces neither); a raw shard holding it whole
        # still serves it without a gather
        if not staged and not found.in_shard:
            pieces = tuple(self.direct.pieces(region, param_dtype) or ())
        return Entry(PLAIN, region.hf_name, region.box, (i,), (region.nbytes,), found.ranks, pieces=pieces)

    def _quantized(
        self,
        plan: ShardingPlan,
        quant: tuple[QuantizedSource | None, ...],
        members: tuple[int, ...],
        covers: list[Cover],
    ) -> list[Entry]:
        first = quant[members[0]]
        assert first is not None
        meta, cover = self.metas[first.weight], first.cover
        sizes = tuple(plan.regions[i].nbytes for i in members)
        gathered = self.ownership.holders(meta.name, self.scope)
        if not self.shard_reads:  # the strategy gathers every tensor it serves: every block is whole there
            return [Entry(TRAINER, meta.name, cover, members, sizes, gathered)]
        whole = tuple(h.rank for h in self.ownership.slices(meta) if h.box.contains(cover))
        if whole:
            return [Entry(TRAINER, meta.name, cover, members, sizes, whole, shard=True)]
        if straddling_share(first, self.ownership, meta) == 0:  # whole blocks in several shards: after the gather
            return [Entry(TRAINER, meta.name, cover, members, sizes, gathered)]
        pieces = self._pieces(meta, cover)
        parts = tuple(q for i in members if (q := quant[i]) is not None)
        covers.append(Cover(meta.name, cover, members, parts, len(pieces), meta.dtype))
        index, itemsize = len(covers) - 1, meta.dtype.itemsize
        return [
            Entry(ENGINE, meta.name, box, (), (box.numel * itemsize,), ranks, shard=True, cover=index)
            for box, ranks in pieces.items()
        ]

    def _pieces(self, meta: TensorMeta, cover: Box) -> dict[Box, tuple[int, ...]]:
        """The cover cut at raw shard boundaries: piece -> the ranks whose raw shard holds it."""
        out: dict[Box, list[int]] = defaultdict(list)
        for h in self.ownership.slices(meta):
            piece = intersection(h.box, cover)
            if piece is not None:
                out[piece].append(h.rank)
        return {box: tuple(ranks) for box, ranks in out.items()}


def mappable(entry: Entry) -> bool:
    """Whether an engine rank that maps the serving rank's arena (``Transport.maps_peers``, on its own device) may
    quantize ``entry`` itself, straight from the raw shard into its parameters, instead of pulling it packed: a
    ``trainer`` cover lying in one raw shard (the trainer would quantize exactly those bytes)."""
    return entry.transform == TRAINER and entry.shard


def intersection(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` contain, or None if they do not overlap."""
    start = tuple(max(x, y) for x, y in zip(a.start, b.start, strict=True))
    stop = tuple(min(x, y) for x, y in zip(a.stop, b.stop, strict=True))
    return Box(start, stop) if all(lo < hi for lo, hi in zip(start, stop, strict=True)) else None


def _metas(
    ownership: Owners, direct: DirectPlanner | None, tensors: Sequence[TensorMeta] | None
) -> dict[str, TensorMeta]:
    if tensors is not None:
        return {t.name: t for t in tensors}
    if direct is not None:
        return dict(direct.metas)
    if isinstance(ownership, Ownership):
        return {t.name: t for t in hf_tensors(ownership.cfg)}
    raise PlanError("plan entries of a declared ownership need the source's tensors")


def plan_entries(
    plans: Sequence[ShardingPlan],
    ownership: Owners,
    strategy: Strategy,
    direct: DirectPlanner | None = None,
    shard_reads: bool | None = None,
    tensors: Sequence[TensorMeta] | None = None,
) -> tuple[EntryPlan, ...]:
    """The entries of each plan (indexed like ``plans``: by local engine rank) under ``strategy``."""
    planner = EntryPlanner(ownership, strategy, direct, shard_reads, tensors)
    return tuple(planner.plan(p) for p in plans)
