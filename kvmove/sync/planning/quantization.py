"""Quantizing inside a sync, as pure planning: how each region of an FP8 engine's plan is made from BF16 shards.

An FP8 engine's plan (kvmove.sync.planning.plan over the FP8 checkpoint of kvmove.models.checkpoint) has regions reading
``X.weight`` (e4m3fn) and ``X.weight_scale_inv`` (float32). The trainer holds neither, only BF16 ``X.weight``;
but each is exactly one part of quantizing a block-aligned box of it, since whole blocks quantize alone to the
whole tensor's bits (kvmove.quant.fp8). :func:`quantized_source` names that box and part; :func:`quantize_side`
says whether each of its blocks lies in one trainer rank's raw shard (``"trainer"``: the holders quantize
before the bytes leave, so only FP8 and scales cross the link) or some block straddles trainer shards
(``"engine"``: the engine pulls the BF16 blocks and quantizes them). kvmove.sync.planning.entries turns these
into the entries a sync routes and pulls; kvmove.sync.transforms executes them (docs/notes/fp8.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.errors import PlanError
from kvmove.models.checkpoint import SCALE_SUFFIX
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.quant import BLOCK, FP8_DTYPE, covering_blocks, quantize, scale_shape, scale_to_weight_box
from kvmove.sync.planning.ownership import Owners, Ownership
from kvmove.sync.planning.plan import Box, Region, ShardingPlan, relative_view
from kvmove.sync.planning.recording import StridedView


class QuantizedSource(NamedTuple):
    """One FP8 region as a part of quantizing a block-aligned box of the trainer's BF16 tensor."""

    weight: str
    """The BF16 HF tensor (``...proj.weight``)."""
    cover: Box
    """The whole blocks of ``weight`` to quantize."""
    part: str
    """``"weight"`` (e4m3fn, shaped like ``cover``) or ``"scale"`` (float32, one per block of ``cover``)."""
    view: StridedView
    """The region inside that part (a contiguous tensor)."""

    @property
    def bf16_bytes(self) -> int:
        return self.cover.numel * 2


def is_quantized(region: Region) -> bool:
    """Whether ``region`` is made by quantizing BF16 (an FP8 weight or its scales), not loaded as held."""
    return region.dtype == FP8_DTYPE or region.hf_name.endswith(SCALE_SUFFIX)


def quantized_source(region: Region, weight_shape: Sequence[int]) -> QuantizedSource | None:
    """How ``region`` is made from BF16, or None when the engine loads its tensor unquantized."""
    if not is_quantized(region):
        return None
    scale = region.hf_name.endswith(SCALE_SUFFIX)
    if region.src is None:
        raise PlanError(f"FP8 region {region.param} <- {region.hf_name} reads no box of its tensor")
    shape = tuple(weight_shape)
    if scale:
        cover = Box(*scale_to_weight_box(region.box.start, region.box.stop, shape))
        view = relative_view(region.src, scale_shape(shape), region.box)
        return QuantizedSource(region.hf_name.removesuffix(SCALE_SUFFIX), cover, "scale", view)
    cover = Box(*covering_blocks(region.box.start, region.box.stop, shape))
    return QuantizedSource(region.hf_name, cover, "weight", relative_view(region.src, shape, cover))


def quantized_sources(cfg: ModelConfig, plan: ShardingPlan) -> tuple[QuantizedSource | None, ...]:
    """:func:`quantized_source` of every region of ``plan``, in order."""
    shapes = {t.name: t.shape for t in hf_tensors(cfg)}
    return tuple(quantized_source(r, shapes[r.hf_name.removesuffix(SCALE_SUFFIX)]) for r in plan.regions)


def quantized_data(source: QuantizedSource, cover: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """The region's bytes from the BF16 ``cover`` box (``bf16[source.cover.slices()]``): quantize, then view."""
    q = quantize(cover, backend=backend, name=source.weight)
    return source.view.apply(q.weight if source.part == "weight" else q.scale_inv)


def straddling_share(source: QuantizedSource, ownership: Owners, meta: TensorMeta) -> float:
    """The share of the cover's elements in blocks that straddle two trainer raw shards of ``meta``.

    Shards split one dim at a time, so a block straddles when a shard boundary along a dim falls strictly
    inside it; the cover being a box, the shares along its two matrix dims combine as ``1 - (1-r)(1-c)``.
    """
    cover, shares = source.cover, []
    for d in (-2, -1):
        lo, hi = cover.start[d], cover.stop[d]
        cuts = {b for h in ownership.slices(meta) for b in (h.box.start[d], h.box.stop[d]) if lo < b < hi}
        blocks = {b // BLOCK for b in cuts if b % BLOCK}
        cut = sum(min(hi, (k + 1) * BLOCK) - max(lo, k * BLOCK) for k in blocks)
        shares.append(cut / (hi - lo))
    return 1 - (1 - shares[0]) * (1 - shares[1])


def quantize_side(source: QuantizedSource, ownership: Owners, meta: TensorMeta) -> str:
    """``"trainer"`` when every block of the cover lies inside one trainer rank's raw shard, else ``"engine"``.

    Trainer-side, each holder quantizes the whole blocks it holds (a cover spanning several shards is served
    in pieces cut at shard boundaries, which are block boundaries there); a block that straddles two shards
    can only be quantized where both halves meet: on the engine (or on a trainer after a gather). A region
    with some straddling blocks can be split: :func:`straddling_share` is the part that must go engine-side.
    """
    return "engine" if straddling_share(source, ownership, meta) > 0 else "trainer"


class QuantTraffic(NamedTuple):
    """Bytes one replica of an FP8 engine receives, by where its blocks would be quantized.

    Regions with both kinds of blocks are counted as split at block boundaries: their whole-shard blocks
    trainer-side, their straddling blocks engine-side.
    """

    regions: int
    """Quantized regions (FP8 weights and scales)."""
    split_regions: int
    """Of those, regions with at least one straddling block."""
    trainer_bytes: int
    """FP8 weights and scales quantized on the trainer: what crosses the link for them."""
    engine_fp8_bytes: int
    """FP8 weights and scales of straddling blocks, quantized on the engine."""
    engine_bf16_bytes: int
    """The BF16 blocks the engine pulls to quantize those (each box once per rank)."""
    plain_bytes: int
    """Regions loaded unquantized (embeddings, norms, router), in BF16."""


def quant_traffic(
    cfg: ModelConfig, layout: EngineLayout, plans: Sequence[ShardingPlan], own: Ownership
) -> QuantTraffic:
    """Sum :func:`straddling_share` over the regions of the ranks of one replica."""
    metas = {t.name: t for t in hf_tensors(cfg)}
    regions = split = plain = 0
    trainer = engine = bf16 = 0.0
    for rank in range(layout.ranks_per_replica):
        plan = plans[layout.coord(rank).local]
        covers: set[tuple[str, Box]] = set()
        for region, src in zip(plan.regions, quantized_sources(cfg, plan), strict=True):
            if src is None:
                plain += region.nbytes
                continue
            share = straddling_share(src, own, metas[src.weight])
            regions, split = regions + 1, split + (share > 0)
            trainer, engine = trainer + region.nbytes * (1 - share), engine + region.nbytes * share
            if share and (src.weight, src.cover) not in covers:
                covers.add((src.weight, src.cover))
                bf16 += src.bf16_bytes * share
    return QuantTraffic(regions, split, round(trainer), round(engine), round(bf16), plain)
