"""Sharding plans: per engine rank, every destination region, the HF slice that fills it, and its bytes.

A plan is built by a dry run of the engine's own loader over recording tensors (kvmove.sync.planning.recording).
Decoder layers of one kind are identical up to their index, so by default the loader runs over one
*template* layer of each kind per pipeline stage and the captures are renamed for the others (structural
reuse); ``reuse=False`` runs the loader over every layer, and tests check that both agree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from math import prod
from operator import le, sub
from typing import NamedTuple

import torch

from kvmove.engines import EngineAdapter, get_engine
from kvmove.errors import PlanError
from kvmove.models.checkpoint import engine_tensors
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineCoord, EngineLayout
from kvmove.models.table import layer_kind
from kvmove.models.tensors import TensorMeta, layer_of
from kvmove.sync.planning.recording import Capture, Op, StridedView, dry_run


class Box(NamedTuple):
    """A rectangular slice of a tensor: ``start[d] <= i_d < stop[d]`` in every dim."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(sub, self.stop, self.start))

    @property
    def numel(self) -> int:
        return prod(map(sub, self.stop, self.start))

    def contains(self, other: Box) -> bool:
        if len(self.start) != len(other.start):
            raise ValueError(f"boxes of {len(self.start)} and {len(other.start)} dims")
        return all(map(le, self.start, other.start)) and all(map(le, other.stop, self.stop))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))


def _unravel(flat: int, shape: Sequence[int]) -> list[int]:
    out = []
    for s in reversed(shape):
        flat, r = divmod(flat, s)
        out.append(r)
    return out[::-1]


def view_box(view: StridedView, shape: Sequence[int]) -> Box | None:
    """The smallest box of a contiguous tensor of ``shape`` holding every element ``view`` reads (the view may
    skip elements inside it, e.g. the query rows of a fused QKV tensor), or None if a view dim walks no single
    tensor dim."""
    if view.numel == 0:
        return None
    strides = contiguous_strides(shape)
    start = _unravel(view.offset, shape)
    stop = [a + 1 for a in start]
    for n, st in zip(view.shape, view.stride, strict=True):
        if n == 1:
            continue
        dim = _walked_dim(st, n, shape, strides)
        if dim is None:
            return None
        stop[dim] += (st // strides[dim]) * (n - 1)
    if any(b > n for b, n in zip(stop, shape, strict=True)):
        return None
    return Box(tuple(start), tuple(stop))


def _walked_dim(stride: int, n: int, shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """The tensor dim a view dim of ``n`` elements and ``stride`` walks along (None: it mixes dims)."""
    return next((d for d, fs in enumerate(strides) if stride % fs == 0 and (stride // fs) * (n - 1) < shape[d]), None)


def relative_view(view: StridedView, shape: Sequence[int], box: Box) -> StridedView:
    """Re-express ``view`` (over the full tensor) over a contiguous copy of ``box`` of that tensor.

    Each view dim must walk along one tensor dim (true for narrow/chunk/select/transpose/permute views).
    """
    if box == Box.full(shape):
        return view
    full_strides = contiguous_strides(shape)
    box_strides = contiguous_strides(box.shape)
    start = _unravel(view.offset, shape)
    offset = sum((c - b) * s for c, b, s in zip(start, box.start, box_strides, strict=True))
    strides = []
    for n, s in zip(view.shape, view.stride, strict=True):
        if n == 1:
            strides.append(0)
            continue
        dim = _walked_dim(s, n, shape, full_strides)
        if dim is None:
            raise PlanError(
                f"view {view} of a {tuple(shape)} tensor mixes tensor dims; it cannot be served from a shard"
            )
        strides.append((s // full_strides[dim]) * box_strides[dim])
    return StridedView(offset, view.shape, tuple(strides))


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


class SourceTensors(NamedTuple):
    """The trainer's tensors as a dry run sees them: ``tensors(layers)`` lists them (only those decoder layers,
    plus the tensors outside layers), ``to_hf`` converts named ones to HF names with view ops only."""

    tensors: Callable[[Sequence[int] | None], list[TensorMeta]]
    to_hf: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]]

    @classmethod
    def hf(cls, cfg: ModelConfig) -> SourceTensors:
        """The checkpoint this engine loads, as is (FP8 engines' carry scales: kvmove.models.checkpoint)."""
        return cls(lambda layers: engine_tensors(cfg, layers), lambda named: named)


class Region(NamedTuple):
    """One destination region of an engine parameter and the slice of a source tensor that fills it.

    ``hf_name`` names the source tensor: an HF checkpoint tensor, or the trainer's own tensor when its format
    is another (megatron-core's ``linear_qkv``...), whose conversion to HF is then part of ``ops``."""

    hf_name: str
    ops: tuple[Op, ...]
    """The loader's op chain on the full HF tensor (replayable with kvmove.sync.planning.recording.replay)."""
    src: StridedView | None
    """The region as a view of the HF tensor; None if an op copied (then only the full tensor can serve)."""
    box: Box
    """The part of the HF tensor the region reads."""
    param: str
    dst: StridedView
    dtype: torch.dtype
    nbytes: int


class ParamMeta(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class ShardingPlan:
    """What one engine rank (in every replica) receives: ``regions`` fill ``params``."""

    coord: EngineCoord
    regions: tuple[Region, ...]
    params: tuple[ParamMeta, ...]
    staged: frozenset[str] = frozenset()
    """Parameters the engine stages and processes before they serve (kvmove.vllm.staging): they receive
    packed pulls only, never direct reads into their memory."""

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    def hf_names(self) -> set[str]:
        return {r.hf_name for r in self.regions}


def _region(cap: Capture, shapes: dict[str, tuple[int, ...]]) -> Region:
    shape = shapes[cap.source]
    box = view_box(cap.src, shape) if cap.src is not None else None
    src = cap.src if box is not None else None
    nbytes = cap.dst.numel * cap.src_dtype.itemsize
    return Region(cap.source, cap.ops, src, box or Box.full(shape), cap.param, cap.dst, cap.src_dtype, nbytes)


def plan_rank(
    cfg: ModelConfig,
    layout: EngineLayout,
    coord: EngineCoord,
    *,
    reuse: bool = True,
    engine: EngineAdapter | None = None,
    source: SourceTensors | None = None,
) -> ShardingPlan:
    """Dry-run the engine's loader for one engine rank and return its sharding plan.

    ``source``: the trainer's tensors and their conversion to HF (default: the HF checkpoint itself); the
    loader then reads the conversion's views of recording tensors of the trainer's own tensors.
    """
    engine = engine or get_engine("reference")
    source = source or SourceTensors.hf(cfg)
    held = list(layout.stage_layers(cfg)[coord.pp])
    templates: dict[str, int] = {}
    for i in held:
        templates.setdefault(layer_kind(cfg, i), i)
    run_layers = sorted(templates.values()) if reuse else held
    model = engine.build(cfg, layout, coord, layers=run_layers, device="meta")
    tensors = source.tensors(run_layers)
    shapes = {t.name: t.shape for t in tensors}
    captures = dry_run(model, tensors, lambda ws: engine.load_weights(model, source.to_hf(ws)))
    params = [ParamMeta(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    regions = [_region(c, shapes) for c in captures]
    if reuse:
        regions, params = _expand(cfg, held, templates, regions, params)
    _check_coverage(coord, params, regions)
    return ShardingPlan(coord, tuple(regions), tuple(params))


class Expanded(NamedTuple):
    """A rank's regions and parameters over every layer it holds, from one recorded layer of each kind."""

    regions: list[Region]
    params: list[ParamMeta]


def _expand(
    cfg: ModelConfig,
    held: list[int],
    templates: dict[str, int],
    regions: list[Region],
    params: list[ParamMeta],
) -> Expanded:
    by_layer: dict[int | None, list[Region]] = defaultdict(list)
    for r in regions:
        by_layer[layer_of(r.hf_name)].append(r)
    params_by_layer: dict[int | None, list[ParamMeta]] = defaultdict(list)
    for p in params:
        params_by_layer[_param_layer(p.name)].append(p)
    out_r, out_p = list(by_layer[None]), list(params_by_layer[None])
    for i in held:
        t = templates[layer_kind(cfg, i)]
        old, new = f"layers.{t}.", f"layers.{i}."
        out_r += [
            Region(r.hf_name.replace(old, new, 1), r.ops, r.src, r.box, r.param.replace(old, new, 1), *r[5:])
            for r in by_layer[t]
        ]
        out_p += [ParamMeta(p.name.replace(old, new, 1), p.shape, p.dtype) for p in params_by_layer[t]]
    return Expanded(out_r, out_p)


def _param_layer(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        idx = parts.index("layers") + 1
        if idx < len(parts) and parts[idx].isdigit():
            return int(parts[idx])
    return None


def _check_coverage(coord: EngineCoord, params: list[ParamMeta], regions: list[Region]) -> None:
    covered: dict[str, int] = defaultdict(int)
    for r in regions:
        covered[r.param] += r.dst.numel
    for p in params:
        if covered[p.name] == 0:
            raise PlanError(f"engine rank {coord.rank}: parameter {p.name} receives no data from any HF tensor")
        if covered[p.name] > p.numel:
            raise PlanError(f"engine rank {coord.rank}: regions written into {p.name} overlap")


def plan_engine(
    cfg: ModelConfig,
    layout: EngineLayout,
    *,
    reuse: bool = True,
    engine: EngineAdapter | None = None,
    source: SourceTensors | None = None,
) -> tuple[ShardingPlan, ...]:
    """Plans of the ranks of one replica (replicas are identical; index plans by ``coord.local``)."""
    return tuple(
        plan_rank(cfg, layout, layout.coord(r), reuse=reuse, engine=engine, source=source)
        for r in range(layout.ranks_per_replica)
    )
