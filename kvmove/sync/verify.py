"""Bit-exact checks: engine parameters filled from plans vs. the engine's own loader fed the full checkpoint."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from kvmove.engines import EngineAdapter, get_engine
from kvmove.errors import PlanError
from kvmove.models.checkpoint import engine_checkpoint, scale_name
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.models.weights import seeded_checkpoint, seeded_tensor
from kvmove.sync.planning.entries import PLAIN
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.packing import ServeSpec, pack_layout
from kvmove.sync.planning.plan import Box, Region, ShardingPlan, relative_view
from kvmove.sync.planning.recording import replay
from kvmove.sync.planning.routing import SourceMap
from kvmove.sync.strategies import Gather
from kvmove.sync.transforms import Held, Lander, pack


class VerifyResult(NamedTuple):
    ok: bool
    engine_ranks: int
    params_checked: int
    mismatches: tuple[str, ...]


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
    """Fill every engine rank as a sync does, in this process: each routed entry packed by its trainer rank from
    what that rank holds (its raw shard, or the tensor its gather of ``scope`` makes) and landed by the engine's
    side of its transform (kvmove.sync.transforms); then compare with the engine's own loader on the full
    checkpoint (in the engine's format: an FP8 engine's quantizer on whole tensors)."""
    engine = engine or get_engine("reference")
    full = seeded_checkpoint(cfg, seed)
    checkpoint = engine_checkpoint(cfg, full)
    held = _Holdings(ownership, full, scope)
    references: dict[int, dict[str, torch.Tensor]] = {}
    mismatches: list[str] = []
    checked = 0
    for e in range(layout.world):
        coord = layout.coord(e)
        if coord.local not in references:
            ref = engine.build(cfg, layout, coord)
            engine.load_weights(ref, checkpoint.items())
            references[coord.local] = {n: p.data for n, p in ref.named_parameters()}
        got = engine.build(cfg, layout, coord)
        plan, entries = plans[coord.local], source_map.entries[coord.local]
        params = dict(got.named_parameters())
        lander = Lander(params, plan, entries)
        for i, (entry, rank) in enumerate(zip(entries.entries, source_map.sources[e], strict=True)):
            if (e, i) in source_map.pieces:  # read directly piece by piece, each from its rank's raw shard
                mismatches += [f"engine rank {e}: {m}" for m in _land_pieces(source_map.pieces[(e, i)], held, params)]
                continue
            spec = ServeSpec.of(entry, plan, entries, tuple(full[entry.tensor].shape))
            source = held.shard(entry.tensor, rank) if entry.shard else held.gathered(entry.tensor, rank)
            if entry.transform == PLAIN:
                region_data(plan.regions[entry.regions[0]], source.tensor, full[entry.tensor])
            buf = torch.empty(pack_layout(spec.sizes).nbytes, dtype=torch.uint8)
            pack(buf, [spec], [source])
            lander.land([entry], buf)
        if lander.pending_covers:
            mismatches.append(f"engine rank {e}: {lander.pending_covers} covers never got all their pieces")
        for name, p in got.named_parameters():
            checked += 1
            if not bits_equal(p.data, references[coord.local][name]):
                mismatches.append(f"engine rank {e}: {name}")
    return VerifyResult(not mismatches, layout.world, checked, tuple(mismatches))


def _land_pieces(pieces: Sequence[tuple[int, Region]], held: _Holdings, params: dict[str, nn.Parameter]) -> list[str]:
    """Write each piece of a region read in pieces as its direct read does: the piece's view of the raw shard of
    the rank routed to serve it, into its part of the parameter. Returns what could not be read there."""
    bad = []
    for rank, piece in pieces:
        try:
            shard = held.shard(piece.hf_name, rank)
            if piece.src is None or not shard.box.contains(piece.box):
                raise PlanError(f"its raw shard {shard.box} does not hold the piece")
            data = relative_view(piece.src, tuple(held.full[piece.hf_name].shape), shard.box).apply(shard.tensor)
        except PlanError as exc:
            bad.append(f"{piece.param} piece {piece.box} <- trainer rank {rank}: {exc}")
            continue
        piece.dst.apply(params[piece.param].data).copy_(data)
    return bad


class _Holdings:
    """What each trainer rank holds of the seeded checkpoint: raw shards, and tensors after a gather (cached)."""

    def __init__(self, ownership: Ownership, full: dict[str, torch.Tensor], scope: Gather | str) -> None:
        self.ownership, self.full, self.scope = ownership, full, scope
        self.metas = {t.name: t for t in hf_tensors(ownership.cfg)}
        self._cache: dict[tuple[str, int, bool], Held] = {}

    def gathered(self, name: str, rank: int) -> Held:
        key = (name, rank, False)
        if key not in self._cache:
            tensor = held_tensor(self.ownership, self.metas[name], self.full[name], rank, self.scope)
            self._cache[key] = Held(tensor, Box.full(tensor.shape))
        return self._cache[key]

    def shard(self, name: str, rank: int) -> Held:
        key = (name, rank, True)
        if key not in self._cache:
            box = next((h.box for h in self.ownership.slices(self.metas[name]) if h.rank == rank), None)
            if box is None:
                raise PlanError(f"trainer rank {rank} holds no raw shard of {name}, yet serves it from one")
            self._cache[key] = Held(self.full[name][box.slices()].contiguous(), box)
        return self._cache[key]


def verify_streaming(
    cfg: ModelConfig, plan: ShardingPlan, model: nn.Module, seed: int, version: int, device: str = "cpu"
) -> VerifyResult:
    """Every region of ``plan`` in ``model`` equals the loader's op chain replayed on the seeded full tensor
    (generated on ``device``, put in the engine's format there - an FP8 engine quantizes it whole - then moved
    to the parameter's device).

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
        if not by_name.keys() & {meta.name, scale_name(meta.name)}:
            continue
        for name, tensor in engine_checkpoint(cfg, {meta.name: seeded_tensor(meta, seed, version, device)}).items():
            bad += [
                f"{r.param} <- {name}"
                for r in by_name.get(name, ())
                if not bits_equal(
                    r.dst.apply(params[r.param].data),
                    replay(r.ops, tensor).reshape(r.dst.shape).to(params[r.param].device),
                )
            ]
    return VerifyResult(not bad, 1, len(plan.regions), tuple(bad))
