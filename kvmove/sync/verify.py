"""Bit-exact checks: engine parameters filled from plans vs. the engine's own loader fed the full checkpoint."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from kvmove.engines import EngineAdapter, get_engine
from kvmove.errors import KvmoveError, PlanError
from kvmove.layout import EngineLayout
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import TensorMeta, hf_tensors, model_totals
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.plan import Box, Region, ShardingPlan, relative_view
from kvmove.sync.planning.recording import replay
from kvmove.sync.planning.routing import SourceMap
from kvmove.sync.strategies import Gather

VERIFY_LIMIT_BYTES = 2 << 30


class VerifyResult(NamedTuple):
    ok: bool
    engine_ranks: int
    params_checked: int
    mismatches: tuple[str, ...]


def seeded_tensor(t: TensorMeta, seed: int, version: int = 0, device: str = "cpu") -> torch.Tensor:
    """Deterministic random weights for one HF tensor (same name, seed, version and device kind: same bits)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + version * 7919 + zlib.crc32(t.name.encode())) & 0x7FFFFFFF)
    if device == "cpu":
        return torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
    return torch.randn(t.shape, generator=g, dtype=t.dtype, device=device)


def check_verifiable(cfg: ModelConfig) -> None:
    """Refuse (before any work) models whose full checkpoint is too large to materialize here."""
    total = model_totals(cfg).total_bytes
    if total > VERIFY_LIMIT_BYTES:
        raise KvmoveError(
            f"verifying {cfg.name} would materialize its full checkpoint ({total / 1e9:.1f} GB); "
            "use a small preset (e.g. qwen3-moe-tiny) or --override to shrink it"
        )


def seeded_checkpoint(cfg: ModelConfig, seed: int, version: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The full checkpoint with seeded random weights, generated on ``device`` (the kind of device decides the
    bits: generate where the trainer does); refuses models too large to materialize here."""
    check_verifiable(cfg)
    return {t.name: seeded_tensor(t, seed, version, device) for t in hf_tensors(cfg)}


def saved_checkpoint(cfg: ModelConfig, directory: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The HF checkpoint a trainer saved in ``directory`` (``*.safetensors``, as ``save_pretrained`` writes them),
    checked to hold exactly the tensors of ``cfg`` with their shapes and dtypes."""
    from pathlib import Path

    try:
        from safetensors.torch import load_file
    except ImportError:
        raise KvmoveError("reading a saved checkpoint needs safetensors: pip install 'kvmove[train]'") from None
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise KvmoveError(f"no *.safetensors checkpoint in {directory}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f), device=device))
    want = {t.name: t for t in hf_tensors(cfg)}
    for name in sorted(set(want) ^ set(out))[:1]:
        where = "lacks" if name in want else "has a tensor not in the model:"
        raise KvmoveError(f"the checkpoint in {directory} {where} {name}")
    for t in want.values():
        if tuple(out[t.name].shape) != t.shape or out[t.name].dtype != t.dtype:
            raise KvmoveError(
                f"{t.name} in {directory} is {tuple(out[t.name].shape)} {out[t.name].dtype}, not {t.shape}"
            )
    return {t.name: out[t.name] for t in want.values()}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def held_tensor(
    ownership: Ownership, meta: TensorMeta, full: torch.Tensor, rank: int, scope: Gather | str
) -> torch.Tensor:
    """The full tensor as trainer ``rank`` holds it after its gather, assembled from the raw shard metadata."""
    if Gather(scope) is Gather.STAGE:
        group = set(ownership.gather_group(meta, rank))
        pieces = [h for h in ownership.slices(meta) if h.rank in group]
    else:
        seen: dict[Box, int] = {}
        for h in ownership.slices(meta):
            seen.setdefault(h.box, h.rank)
        pieces = [h for h in ownership.slices(meta) if seen[h.box] == h.rank]
    out = torch.empty_like(full)
    covered = torch.zeros(full.shape, dtype=torch.int32)
    for h in pieces:
        out[h.box.slices()] = full[h.box.slices()]  # the shard rank h.rank holds
        covered[h.box.slices()] += 1
    if not bool((covered == 1).all()):
        raise PlanError(f"trainer shards of {meta.name} do not tile it exactly for rank {rank}'s gather")
    return out


def region_data(region: Region, held: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The bytes a trainer serves for ``region``; cross-checked against replaying the loader's op chain."""
    if region.src is not None:
        local = held[region.box.slices()].contiguous()
        data = relative_view(region.src, tuple(full.shape), region.box).apply(local)
    else:
        data = replay(region.ops, held).reshape(region.dst.shape)
    if not bits_equal(data.contiguous(), replay(region.ops, full).reshape(region.dst.shape).contiguous()):
        raise PlanError(f"region {region.param} <- {region.hf_name}: strided view disagrees with the op chain")
    return data


def apply_regions(model: nn.Module, regions: Iterable[tuple[Region, torch.Tensor]]) -> None:
    """Write region payloads into ``model``'s parameters at their recorded offset/shape/stride."""
    params = dict(model.named_parameters())
    for region, data in regions:
        region.dst.apply(params[region.param].data).copy_(data.reshape(region.dst.shape))


def verify_plans(
    cfg: ModelConfig,
    layout: EngineLayout,
    plans: Sequence[ShardingPlan],
    ownership: Ownership,
    source_map: SourceMap,
    scope: Gather | str,
    *,
    seed: int = 0,
    engine: EngineAdapter | None = None,
) -> VerifyResult:
    """Fill every engine rank from its plan and routed sources, compare with the loader on full tensors."""
    engine = engine or get_engine("reference")
    full = seeded_checkpoint(cfg, seed)
    metas = {t.name: t for t in hf_tensors(cfg)}
    held_cache: dict[tuple[str, int], torch.Tensor] = {}
    references: dict[int, nn.Module] = {}
    mismatches: list[str] = []
    checked = 0
    for e in range(layout.world):
        coord = layout.coord(e)
        if coord.local not in references:
            ref = engine.build(cfg, layout, coord)
            engine.load_weights(ref, full.items())
            references[coord.local] = ref
        got = engine.build(cfg, layout, coord)
        payloads = []
        for region, rank in zip(plans[coord.local].regions, source_map.sources[e], strict=True):
            key = (region.hf_name, rank)
            if key not in held_cache:
                held_cache[key] = held_tensor(ownership, metas[region.hf_name], full[region.hf_name], rank, scope)
            payloads.append((region, region_data(region, held_cache[key], full[region.hf_name])))
        apply_regions(got, payloads)
        want = dict(references[coord.local].named_parameters())
        for name, p in got.named_parameters():
            checked += 1
            if not bits_equal(p.data, want[name].data):
                mismatches.append(f"engine rank {e}: {name}")
    return VerifyResult(not mismatches, layout.world, checked, tuple(mismatches))


def verify_streaming(
    cfg: ModelConfig, plan: ShardingPlan, model: nn.Module, seed: int, version: int, device: str = "cpu"
) -> tuple[bool, list[str]]:
    """Every region of ``plan`` in ``model`` equals the loader's op chain replayed on the seeded full tensor
    (generated on ``device``, then moved to the parameter's device).

    One HF tensor is materialized at a time, so this scales to models whose full checkpoint does not fit
    beside the engine's parameters (e.g. tens of GB on one GPU). It trusts the plan, which the dry-run
    verification checks bit-exact against the engine's own loader.
    """
    params = dict(model.named_parameters())
    by_name: dict[str, list[Region]] = {}
    for region in plan.regions:
        by_name.setdefault(region.hf_name, []).append(region)
    bad: list[str] = []
    for meta in hf_tensors(cfg):
        regions = by_name.get(meta.name)
        if not regions:
            continue
        full = seeded_tensor(meta, seed, version, device)
        bad += [
            f"{r.param} <- {meta.name}"
            for r in regions
            if not bits_equal(
                r.dst.apply(params[r.param].data), replay(r.ops, full).reshape(r.dst.shape).to(params[r.param].device)
            )
        ]
    return not bad, bad
