"""Dry-run plans of an FP8 engine: scales are regions, and the plans replay bit-exactly (from the FP8
checkpoint, and from BF16 by quantizing whole blocks), against the engine's own loader."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvmove.engines import get_engine, reference_models
from kvmove.models import hf_tensors, resolve_model
from kvmove.models.checkpoint import engine_checkpoint, with_engine_dtype
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.weights import seeded_checkpoint
from kvmove.quant import FP8_DTYPE
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.plan import plan_engine
from kvmove.sync.planning.quantization import (
    quant_traffic,
    quantize_side,
    quantized_data,
    quantized_sources,
    straddling_share,
)
from kvmove.sync.planning.recording import replay
from kvmove.sync.verify import apply_regions, bits_equal

LAYOUTS = [
    ("qwen3-moe-fp8-tiny", "tp=2"),
    ("qwen3-moe-fp8-tiny", "dp=2,ep=2,pp=2"),
    ("deepseek-v3-fp8-tiny", "tp=1"),
    ("deepseek-v3-fp8-tiny", "tp=2,ep=2"),
]
ENGINE = get_engine("reference")


def fp8(model: str):
    return with_engine_dtype(resolve_model(model), "fp8")


def assert_ranks_match(cfg, layout, models, full) -> None:
    for rank, (got, ref) in enumerate(zip(models, reference_models(ENGINE, cfg, layout, full), strict=True)):
        want = dict(ref.named_parameters())
        for name, p in got.named_parameters():
            assert bits_equal(p.data, want[name].data), f"engine rank {rank}: {name}"


@pytest.mark.parametrize(("model", "engine"), LAYOUTS)
def test_scales_are_regions_and_bytes_count_fp8(model: str, engine: str) -> None:
    cfg, layout = fp8(model), EngineLayout.parse(engine)
    for plan in plan_engine(cfg, layout):
        params = {p.name: p for p in plan.params}
        scales = [r for r in plan.regions if r.hf_name.endswith("weight_scale_inv")]
        assert scales and all(r.dtype == torch.float32 and r.param.endswith("_scale_inv") for r in scales)
        for r in plan.regions:
            assert r.dtype == params[r.param].dtype, r
            assert r.nbytes == r.dst.numel * r.dtype.itemsize
        assert {p.name for p in plan.params if p.dtype == FP8_DTYPE} == {
            r.param for r in plan.regions if r.dtype == FP8_DTYPE
        }


@pytest.mark.parametrize(("model", "engine"), LAYOUTS[::2])
def test_template_reuse_equals_full_dry_run(model: str, engine: str) -> None:
    cfg, layout = fp8(model), EngineLayout.parse(engine)
    for reused, full in zip(plan_engine(cfg, layout), plan_engine(cfg, layout, reuse=False), strict=True):
        assert sorted(reused.regions) == sorted(full.regions)


@pytest.mark.parametrize(("model", "engine"), LAYOUTS)
def test_plans_replay_the_fp8_checkpoint_bit_exactly(model: str, engine: str) -> None:
    cfg, layout = fp8(model), EngineLayout.parse(engine)
    full = seeded_checkpoint(cfg, seed=7)
    ckpt = engine_checkpoint(cfg, full)
    models = []
    for rank, plan in enumerate(plan_engine(cfg, layout)):
        models.append(ENGINE.build(cfg, layout, layout.coord(rank)))
        apply_regions(models[-1], [(r, replay(r.ops, ckpt[r.hf_name])) for r in plan.regions])
    assert_ranks_match(cfg, layout, models, full)


@pytest.mark.parametrize(("model", "engine"), LAYOUTS)
def test_plans_replay_from_bf16_by_quantizing_whole_blocks(model: str, engine: str) -> None:
    """What a sync will do: each FP8 region is one part of quantizing the block-aligned BF16 box it covers."""
    cfg, layout = fp8(model), EngineLayout.parse(engine)
    full = seeded_checkpoint(cfg, seed=7)
    models = []
    for rank, plan in enumerate(plan_engine(cfg, layout)):
        payloads = []
        for region, src in zip(plan.regions, quantized_sources(cfg, plan), strict=True):
            if src is None:
                payloads.append((region, replay(region.ops, full[region.hf_name])))
            else:
                payloads.append((region, quantized_data(src, full[src.weight][src.cover.slices()])))
        models.append(ENGINE.build(cfg, layout, layout.coord(rank)))
        apply_regions(models[-1], payloads)
    assert_ranks_match(cfg, layout, models, full)


def sides(model: str, trainer: str, engine: str) -> dict[str, str]:
    cfg, layout = fp8(model), EngineLayout.parse(engine)
    tl = TrainerLayout.parse(trainer)
    tl.validate(resolve_model(model))
    own = Ownership(cfg, tl)
    metas = {t.name: t for t in hf_tensors(cfg)}
    plan = plan_engine(cfg, layout)[0]
    out: dict[str, str] = {}
    for region, src in zip(plan.regions, quantized_sources(cfg, plan), strict=True):
        if src is not None:
            side = quantize_side(src, own, metas[src.weight])
            assert out.setdefault(region.hf_name, side) == side
    return out


def test_aligned_trainer_shards_quantize_on_the_trainer() -> None:
    got = sides("qwen3-moe-fp8-tiny", "tp=2,etp=2", "tp=2")
    assert set(got.values()) == {"trainer"}


def test_block_straddling_trainer_shards_quantize_on_the_engine() -> None:
    """Trainer tp=4: k rows 64 per rank and MLP rows 192 cut the 128-blocks the tp=2 engine needs whole."""
    got = sides("qwen3-moe-fp8-tiny", "tp=4,etp=4", "tp=2")
    a = "model.layers.0."
    assert got[a + "self_attn.q_proj.weight"] == "trainer"  # 128 rows per trainer rank: whole blocks
    assert got[a + "self_attn.k_proj.weight"] == "engine"
    assert got[a + "self_attn.k_proj.weight_scale_inv"] == "engine"
    assert got[a + "self_attn.o_proj.weight"] == "trainer"  # columns: 128 per trainer rank
    assert got[a + "mlp.gate_proj.weight"] == "engine"
    assert got["model.layers.1.mlp.experts.3.up_proj.weight"] == "engine"


def test_traffic_adds_up_to_the_plan() -> None:
    cfg, layout = fp8("deepseek-v3-fp8-tiny"), EngineLayout.parse("tp=2")
    plans = plan_engine(cfg, layout)
    for trainer in ("tp=2", "tp=4,etp=4"):
        tl = TrainerLayout.parse(trainer)
        t = quant_traffic(cfg, layout, plans, Ownership(cfg, tl))
        total = t.trainer_bytes + t.engine_fp8_bytes + t.plain_bytes
        assert abs(total - sum(p.nbytes for p in plans)) <= 1  # shares of split regions are rounded once
        assert (t.split_regions == 0) == (trainer == "tp=2")
        assert t.engine_bf16_bytes >= 2 * t.engine_fp8_bytes * 0.9  # BF16 is about twice FP8 (+ scales)


def test_straddling_share_counts_only_the_cut_blocks() -> None:
    """Engine tp=1 needs all 768 rows of the dense gate_proj; trainer tp=4 cuts them at 192 and 576 (inside
    blocks 1 and 4 of 6) and at 384 (a block boundary): a third of the blocks straddle."""
    cfg = fp8("qwen3-moe-fp8-tiny")
    plan = plan_engine(cfg, EngineLayout.parse("tp=1"))[0]
    own = Ownership(cfg, TrainerLayout.parse("tp=4"))
    metas = {t.name: t for t in hf_tensors(cfg)}
    name = "model.layers.0.mlp.gate_proj.weight"
    for region, src in zip(plan.regions, quantized_sources(cfg, plan), strict=True):
        if region.hf_name in (name, name + "_scale_inv"):
            assert src is not None and src.cover == ((0, 0), (768, 256))
            assert straddling_share(src, own, metas[name]) == pytest.approx(2 / 6)


@pytest.mark.parametrize(
    ("model", "trainer", "engine", "sides"),
    [
        ("qwen3-moe-fp8-tiny", "tp=2,etp=2", "tp=2", {"plain", "trainer"}),  # trainer shards = whole blocks
        ("qwen3-moe-fp8-tiny", "tp=4,etp=4", "tp=2", {"plain", "trainer", "engine"}),  # k/v, MLP, experts cut
        ("deepseek-v3-fp8-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2", {"plain", "trainer"}),
        ("deepseek-v3-fp8-tiny", "tp=4,ep=2,etp=2", "tp=1", {"plain", "trainer", "engine"}),
    ],
)
def test_dry_run_verifies_fp8_syncs_through_pack_and_land(model: str, trainer: str, engine: str, sides) -> None:
    """The dry run fills every engine rank as a sync does (each entry packed by its trainer rank, landed by the
    engine's half of its transform) and compares with reference_models, for every strategy."""
    from kvmove.sync.config import SyncConfig
    from kvmove.sync.driver.dryrun import dry_run_sync
    from kvmove.sync.strategies import STRATEGIES

    config = SyncConfig(
        model=fp8(model),
        trainer=TrainerLayout.parse(trainer),
        engine=EngineLayout.parse(engine),
        strategies=tuple(STRATEGIES.values()),
        verify=True,
        seed=5,
    )
    reports = {r.strategy: r for r in dry_run_sync(config)}
    for r in reports.values():
        assert r.verified is True, (r.strategy, r.mismatches)
        assert r.engine_dtype == "fp8" and sum(r.bytes_by_transform.values()) == r.bytes_total
    assert set(reports["v3"].bytes_by_transform) == sides  # raw shards read in place: straddling blocks engine-side
    assert set(reports["v1"].bytes_by_transform) == {"plain", "trainer"}  # gathered tensors hold every block whole
    bf16 = dry_run_sync(replace(config, model=with_engine_dtype(resolve_model(model), "bf16"), verify=False))
    for r, b in zip(reports.values(), bf16, strict=True):
        # trainer-side covers cross as FP8 (about half of BF16); engine-side pieces cross as BF16
        assert r.bytes_total < b.bytes_total * (1.0 if "engine" in r.bytes_by_transform else 0.6), r.strategy


def test_covers_cut_by_trainer_shards_are_assembled_from_pieces() -> None:
    """Trainer tp=4 cuts the engine tp=2 rank's k_proj block (rows 0..128) at 64: two pieces, one per raw shard,
    land before the engine quantizes the cover; the scale region rides with the weight region."""
    from kvmove.sync.planning.entries import plan_entries
    from kvmove.sync.strategies import STRATEGIES

    cfg, layout = fp8("qwen3-moe-fp8-tiny"), EngineLayout.parse("tp=2")
    own = Ownership(cfg, TrainerLayout.parse("tp=4,etp=4"))
    plan = plan_engine(cfg, layout)[0]
    (entry_plan,) = plan_entries([plan], own, STRATEGIES["v3"], shard_reads=True)
    name = "model.layers.0.self_attn.k_proj.weight"
    cover = next(c for c in entry_plan.covers if c.tensor == name)
    pieces = [e for e in entry_plan.entries if e.cover >= 0 and entry_plan.covers[e.cover] == cover]
    assert cover.box == ((0, 0), (128, 256)) and cover.pieces == len(pieces) == 2
    assert sorted(p.box for p in pieces) == [((0, 0), (64, 256)), ((64, 0), (128, 256))]
    assert [p.holders for p in sorted(pieces, key=lambda p: p.box)] == [(0,), (1,)]
    assert {plan.regions[i].hf_name for i in cover.regions} == {name, name + "_scale_inv"}
    assert sum(p.nbytes for p in pieces) == 128 * 256 * 2  # BF16 on the link
    q = next(e for e in entry_plan.entries if e.tensor == "model.layers.0.self_attn.q_proj.weight")
    # q rows 0..256 lie in two trainer shards, cut at a block boundary: whole blocks after the gather, trainer-side
    assert q.transform == "trainer" and not q.shard and q.holders == (0, 1, 2, 3)
    assert q.sizes == (256 * 256, 2 * 2 * 4)  # FP8 weight + 2x2 float32 scales
