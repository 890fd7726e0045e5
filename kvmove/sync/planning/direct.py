"""Direct pulls (pure planning): engine parameters read straight out of a trainer rank's registered shard arena.

A trainer rank keeps its raw shards (what it holds before any gather) in one *arena*: a single uint8 buffer,
registered with the transport once, overwritten in place every training step (Megatron keeps its parameters in
one contiguous buffer the same way). A region whose slice lies inside the raw shard of the rank serving it, and
whose bytes land unchanged in an engine parameter of the same dtype, needs neither a gather, nor a pack on the
trainer, nor a load on the engine: the engine reads it from the arena into the parameter itself, as byte spans.
A region spanning the raw shards of several ranks (an engine that splits a tensor less, or another way, than the
trainer) is cut into *pieces* along the shard boundaries, each read from a rank holding its shard, so it needs no
gather either. Everything else (dtype casts, loader ops that copy, views that fold tensor dims) keeps the packed
path. With a transport that runs 2-D copies (``Transport.strided``), a region whose rows are short (a column block
of a matrix) is still read directly: its rows fold into a few 2-D copies (``kvmove.transport.copies``).

Both sides derive the arena's offsets from :func:`arena_layout` of the same ownership, so they cannot disagree.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvmove.errors import PlanError
from kvmove.models.tensors import TensorMeta
from kvmove.sync.planning.ownership import Owners
from kvmove.sync.planning.plan import Box, Region, contiguous_strides, relative_view, view_box
from kvmove.sync.planning.recording import StridedView
from kvmove.transport.copies import plan_copies

ARENA_ALIGN = 256
"""Byte alignment of every shard in an arena (a GPU copy's sweet spot; harmless on CPU)."""
MIN_SPAN_BYTES = 4096
"""Regions that split into runs shorter than this are packed instead: per-span costs would dominate (a region
that is one run is always read directly: a pack request would cost more than the read)."""
MAX_SPANS = 4096
"""Regions that split into more byte spans (with a strided transport: copies) than this are packed instead."""


class ArenaLayout(NamedTuple):
    """Where each raw shard of one trainer rank lives in its arena: name -> (byte offset, box of the HF tensor)."""

    offsets: dict[str, int]
    boxes: dict[str, Box]
    nbytes: int


_EXPERT = re.compile(r"^(?P<prefix>.*\.experts\.)(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PROJ_FAMILY = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


def arena_order(tensors: Iterable[TensorMeta]) -> list[TensorMeta]:
    """Checkpoint order, except that each layer's routed experts are grouped as a fused MoE layer holds them:
    every expert's gate and up projection back to back, expert after expert, then every expert's down
    projection (Megatron's grouped-GEMM weights are laid out this way too). An engine's fused ``w13``/``w2``
    parameter then reads one contiguous run of the arena instead of one run per expert."""
    ts = list(tensors)
    keys: dict[str, tuple[int, int, int]] = {}
    first: dict[str, int] = {}
    for i, t in enumerate(ts):
        m = _EXPERT.match(t.name)
        if m is None:
            keys[t.name] = (i, 0, 0)
            continue
        family, within = _PROJ_FAMILY[m["proj"]]
        at = first.setdefault(m["prefix"] + family, i)
        keys[t.name] = (at, int(m["expert"]), within)
    return sorted(ts, key=lambda t: keys[t.name])


def arena_layout(ownership: Owners, tensors: Iterable[TensorMeta], rank: int) -> ArenaLayout:
    """The arena of trainer rank ``rank``: its raw shards in :func:`arena_order`, each ``ARENA_ALIGN``-aligned."""
    return arena_layouts(ownership, tensors, ranks=(rank,))[rank]


def arena_layouts(
    ownership: Owners, tensors: Iterable[TensorMeta], ranks: Iterable[int] | None = None
) -> dict[int, ArenaLayout]:
    """:func:`arena_layout` of every rank in ``ranks`` (default: all), in one pass over the tensors."""
    wanted = set(range(ownership.world) if ranks is None else ranks)
    offsets: dict[int, dict[str, int]] = {r: {} for r in wanted}
    boxes: dict[int, dict[str, Box]] = {r: {} for r in wanted}
    at = dict.fromkeys(wanted, 0)
    for t in arena_order(tensors):
        for h in ownership.slices(t):
            if h.rank in wanted:
                offsets[h.rank][t.name], boxes[h.rank][t.name] = at[h.rank], h.box
                at[h.rank] += -(-h.box.numel * t.dtype.itemsize // ARENA_ALIGN) * ARENA_ALIGN
    return {r: ArenaLayout(offsets[r], boxes[r], max(at[r], ARENA_ALIGN)) for r in wanted}


def check_arena(layout: ArenaLayout, shards: Mapping[str, Box], tensors: Iterable[TensorMeta], rank: int) -> None:
    """A source's own arena layout holds exactly its shards, each aligned to its dtype, inside the arena,
    without overlap (engines read its bytes at these offsets); PlanError naming the first problem otherwise."""
    dtypes = {t.name: t.dtype for t in tensors}
    if layout.boxes != dict(shards):
        raise PlanError(f"trainer rank {rank} offers an arena whose shards differ from the shards it reports")
    spans = []
    for name, off in layout.offsets.items():
        size = layout.boxes[name].numel * dtypes[name].itemsize
        if off < 0 or off + size > layout.nbytes or off % dtypes[name].itemsize:
            raise PlanError(f"trainer rank {rank}: shard {name} at byte {off} does not fit its arena")
        if size:
            spans.append((off, off + size, name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise PlanError(f"trainer rank {rank}: shards {a} and {b} overlap in its arena")


def shard_views(arena: torch.Tensor, layout: ArenaLayout, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Each raw shard as a typed, shaped view of ``arena`` (writing a view writes the arena)."""
    out = {}
    for name, off in layout.offsets.items():
        box, dtype = layout.boxes[name], dtypes[name]
        out[name] = arena[off : off + box.numel * dtype.itemsize].view(dtype).view(box.shape)
    return out


def byte_spans(src: StridedView, dst: StridedView, itemsize: int) -> np.ndarray:
    """``(n, 3)`` int64 (src byte, dst byte, nbytes) runs copying view ``src`` onto view ``dst`` (same shape).

    The innermost dims that are contiguous on both sides form one run; the outer dims enumerate the runs.
    """
    if src.shape != dst.shape:
        raise PlanError(f"views of different shapes {src.shape} and {dst.shape}")
    if _contiguous(src) and _contiguous(dst):
        return np.array([[src.offset * itemsize, dst.offset * itemsize, src.numel * itemsize]], dtype=np.int64)
    inner, k = 1, len(src.shape)
    while k > 0 and (src.shape[k - 1] == 1 or (src.stride[k - 1] == inner and dst.stride[k - 1] == inner)):
        inner *= src.shape[k - 1]
        k -= 1
    s_off = np.array([src.offset], dtype=np.int64)
    d_off = np.array([dst.offset], dtype=np.int64)
    for d in range(k):
        steps = np.arange(src.shape[d], dtype=np.int64)
        s_off = (s_off[:, None] + steps[None, :] * src.stride[d]).reshape(-1)
        d_off = (d_off[:, None] + steps[None, :] * dst.stride[d]).reshape(-1)
    out = np.empty((len(s_off), 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = s_off * itemsize, d_off * itemsize, inner * itemsize
    return out


def cut(region: Region, shape: Sequence[int], box: Box) -> Region | None:
    """The part of ``region`` whose source lies in ``box`` of the tensor (possibly empty: 0 bytes), or None when
    its view cannot be cut there (a view dim walking several tensor dims, or two view dims walking one)."""
    assert region.src is not None
    view, strides = region.src, contiguous_strides(shape)
    start = _unravel(view.offset, shape)
    lo, hi, walked = [], [], set()
    for n, s in zip(view.shape, view.stride, strict=True):
        if n == 1:
            lo.append(0)
            hi.append(1)
            continue
        dim = next((d for d, fs in enumerate(strides) if s == fs and start[d] + n - 1 < shape[d]), None)
        if dim is None or dim in walked:
            return None
        walked.add(dim)
        lo.append(min(n, max(0, box.start[dim] - start[dim])))
        hi.append(max(0, min(n, box.stop[dim] - start[dim])))
    inside = all(box.start[d] <= start[d] < box.stop[d] for d in range(len(shape)) if d not in walked)
    shape_ = tuple(max(0, b - a) for a, b in zip(lo, hi, strict=True))
    if not inside or 0 in shape_:
        return region._replace(nbytes=0)
    src = StridedView(view.offset + sum(a * s for a, s in zip(lo, view.stride, strict=True)), shape_, view.stride)
    dst = region.dst
    dst = StridedView(dst.offset + sum(a * s for a, s in zip(lo, dst.stride, strict=True)), shape_, dst.stride)
    part_box = view_box(src, shape)
    if part_box is None:
        return None
    numel = src.numel
    return region._replace(src=src, dst=dst, box=part_box, nbytes=numel * region.dtype.itemsize)


def _unravel(flat: int, shape: Sequence[int]) -> list[int]:
    out = []
    for s in reversed(shape):
        flat, r = divmod(flat, s)
        out.append(r)
    return out[::-1]


def _contiguous(view: StridedView) -> bool:
    expect = 1
    for n, st in zip(reversed(view.shape), reversed(view.stride), strict=True):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def cheap_spans(runs: np.ndarray, strided: bool) -> bool:
    """Whether reading these byte spans directly costs less than packing them (few enough, large enough copies;
    with a ``strided`` transport, the 2-D copies they fold into)."""
    if not strided:
        return len(runs) <= MAX_SPANS and (len(runs) == 1 or int(runs[0, 2]) >= MIN_SPAN_BYTES)
    plan = plan_copies(runs)
    return plan.ncopies <= MAX_SPANS and (plan.ncopies == 1 or plan.smallest() >= MIN_SPAN_BYTES)


class Piece(NamedTuple):
    """Part of a region lying in one raw shard: the part (a region of its own) and the ranks holding that shard."""

    region: Region
    holders: tuple[int, ...]


class DirectPlanner:
    """Decides, per (region, serving trainer rank), whether the region is read straight from the arena.

    ``strided``: the transport runs 2-D copies, so the per-span limits apply to the copies a region's spans fold
    into, not to its rows.
    """

    def __init__(
        self,
        ownership: Owners,
        tensors: Sequence[TensorMeta],
        arenas: Mapping[int, ArenaLayout] | None = None,
        strided: bool = False,
    ) -> None:
        """``arenas``: each rank's arena as its source laid it out (default: :func:`arena_layout` of each)."""
        self.ownership, self.strided = ownership, strided
        self.metas = {t.name: t for t in tensors}
        self.shapes = {t.name: t.shape for t in tensors}
        layouts = arena_layouts(ownership, tensors) if arenas is None else arenas
        self.arenas = [layouts[r] for r in range(ownership.world)]
        self._shards: dict[tuple[str, tuple[int, ...]], dict[Box, tuple[int, ...]]] = {}

    def spans(self, region: Region, trainer: int, param_dtype: torch.dtype) -> np.ndarray | None:
        """Byte spans (arena offset, parameter offset, nbytes) of ``region`` served by ``trainer``, or None."""
        arena = self.arenas[trainer]
        box = arena.boxes.get(region.hf_name)
        if box is None or region.src is None or region.dtype != param_dtype or not box.contains(region.box):
            return None
        try:
            src = relative_view(region.src, self.shapes[region.hf_name], box)
        except PlanError:
            return None
        runs = byte_spans(src, region.dst, region.dtype.itemsize)
        if not cheap_spans(runs, self.strided):
            return None
        runs[:, 0] += arena.offsets[region.hf_name]
        return runs

    def pieces(self, region: Region, param_dtype: torch.dtype) -> list[Piece] | None:
        """``region`` cut along the raw shards of its tensor, each piece readable from its shard's holders; None if
        it lies in one shard, cannot be cut (a view folding tensor dims, an op that copies) or a piece is not
        cheap to read directly."""
        if region.src is None or region.dtype != param_dtype:
            return None
        meta = self.metas[region.hf_name]
        by_box: dict[Box, list[int]] = {}
        for h in self.ownership.slices(meta):
            by_box.setdefault(h.box, []).append(h.rank)
        if len(by_box) < 2 or any(box.contains(region.box) for box in by_box):
            return None
        out = []
        for box, holders in by_box.items():
            part = cut(region, meta.shape, box)
            if part is None:
                return None
            if part.nbytes and self.spans(part, holders[0], param_dtype) is None:
                return None
            if part.nbytes:
                out.append(Piece(part, tuple(holders)))
        return out if sum(p.region.nbytes for p in out) == region.nbytes else None

    def shard_holders(self, region: Region, candidates: Sequence[int]) -> tuple[int, ...]:
        """The candidates whose raw shard contains the region (serving from them needs no gather)."""
        candidates = tuple(candidates)
        groups = self._shards.get((region.hf_name, candidates))
        if groups is None:
            groups = self._shards[(region.hf_name, candidates)] = self._by_shard(region.hf_name, candidates)
        inside = [ranks for box, ranks in groups.items() if box.contains(region.box)]
        if len(inside) == 1:
            return inside[0]
        held = {r for ranks in inside for r in ranks}
        return tuple(r for r in candidates if r in held)

    def _by_shard(self, name: str, candidates: tuple[int, ...]) -> dict[Box, tuple[int, ...]]:
        """The candidates holding a raw shard of ``name``, grouped by that shard's box (in candidate order)."""
        out: dict[Box, list[int]] = {}
        for r in candidates:
            box = self.arenas[r].boxes.get(name)
            if box is not None:
                out.setdefault(box, []).append(r)
        return {box: tuple(ranks) for box, ranks in out.items()}
