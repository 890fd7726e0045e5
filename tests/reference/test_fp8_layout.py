"""The reference engine's block-FP8 layout: what each rank holds when it loads an FP8 checkpoint."""

from __future__ import annotations

import pytest
import torch

from kvmove.engines import get_engine, reference_models
from kvmove.errors import LayoutError
from kvmove.models import resolve_model
from kvmove.models.checkpoint import engine_checkpoint, is_block_quantized, with_engine_dtype
from kvmove.models.layout import EngineLayout
from kvmove.models.weights import seeded_checkpoint
from kvmove.quant import BLOCK, FP8_DTYPE, quantize
from kvmove.sync.verify import bits_equal

LAYOUTS = [
    ("qwen3-moe-fp8-tiny", "tp=1"),
    ("qwen3-moe-fp8-tiny", "tp=2"),  # KV 4 heads over 2 ranks, experts tp-sharded to 128 rows
    ("qwen3-moe-fp8-tiny", "tp=2,ep=2"),
    ("qwen3-moe-fp8-tiny", "dp=2,ep=2,pp=2"),
    ("deepseek-v3-fp8-tiny", "tp=1"),  # fused_qkv_a: 128 + 192 rows, the last block half full
    ("deepseek-v3-fp8-tiny", "tp=2"),
    ("deepseek-v3-fp8-tiny", "tp=2,ep=2,pp=2"),
]
ENGINE = get_engine("reference")


def ranks(model: str, engine: str, dtype: str):
    cfg = with_engine_dtype(resolve_model(model), dtype)
    layout = EngineLayout.parse(engine)
    layout.validate(cfg)
    return reference_models(ENGINE, cfg, layout, seeded_checkpoint(cfg, seed=3))


@pytest.mark.parametrize(("model", "engine"), LAYOUTS)
def test_fp8_rank_equals_its_bf16_rank_quantized(model: str, engine: str) -> None:
    """Independent of the scale loaders: with 128-aligned splits, each fused FP8 parameter and its scales are
    exactly the BF16 engine's parameter quantized on the rank (every partition starts on a block)."""
    for fp8, bf16 in zip(ranks(model, engine, "fp8"), ranks(model, engine, "bf16"), strict=True):
        got, want = dict(fp8.named_parameters()), dict(bf16.named_parameters())
        scales = {n for n in got if n.endswith("_scale_inv")}
        assert {n.removesuffix("_scale_inv") for n in scales} <= set(want)
        assert set(got) - scales == set(want)
        for name, ref in want.items():
            if name + "_scale_inv" not in got:
                assert bits_equal(got[name].data, ref.data), name
                continue
            q = quantize(ref.data)
            assert got[name].dtype == FP8_DTYPE
            assert bits_equal(got[name].data, q.weight), name
            assert bits_equal(got[name + "_scale_inv"].data, q.scale_inv), name


def test_fp8_layout_holds_the_checkpoints_quantized_set() -> None:
    cfg = with_engine_dtype(resolve_model("deepseek-v3-fp8-tiny"), "fp8")
    layout = EngineLayout.parse("tp=1")
    params = dict(ENGINE.build(cfg, layout, layout.coord(0), device="meta").named_parameters())
    fp8 = {n for n, p in params.items() if p.dtype == FP8_DTYPE}
    assert fp8 == {n.removesuffix("_scale_inv") for n in params if n.endswith("_scale_inv")}
    layer1 = {n.removeprefix("model.layers.1.") for n in fp8 if n.startswith("model.layers.1.")}
    assert layer1 == {
        "self_attn.fused_qkv_a_proj.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.experts.w13_weight",
        "mlp.experts.w2_weight",
        "mlp.shared_experts.gate_up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    }
    for stays in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert params[stays].dtype == torch.bfloat16
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    assert params["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"].shape == (3, 2)  # 320 x 256
    assert params["model.layers.1.mlp.experts.w13_weight_scale_inv"].shape == (8, 4, 2)


def test_scales_of_replicated_kv_heads_and_expert_shards() -> None:
    """Hand-checked slices: tp=2 rank 1 holds q rows 256.., KV rows 128.., expert rows 128.. of gate and up."""
    cfg = with_engine_dtype(resolve_model("qwen3-moe-fp8-tiny"), "fp8")
    layout = EngineLayout.parse("tp=2")
    full = seeded_checkpoint(cfg, seed=3)
    ckpt = engine_checkpoint(cfg, full)
    rank = dict(reference_models(ENGINE, cfg, layout, full)[1].named_parameters())
    a = "model.layers.1.self_attn."
    qkv_s = rank[a + "qkv_proj.weight_scale_inv"]
    assert qkv_s.shape == (4, 2)  # q 256 + k 128 + v 128 rows, 256 columns
    assert bits_equal(qkv_s[:2], ckpt[a + "q_proj.weight_scale_inv"][2:4])
    assert bits_equal(qkv_s[2:3], ckpt[a + "k_proj.weight_scale_inv"][1:2])
    assert bits_equal(qkv_s[3:4], ckpt[a + "v_proj.weight_scale_inv"][1:2])
    o_s = rank[a + "o_proj.weight_scale_inv"]
    assert bits_equal(o_s, ckpt[a + "o_proj.weight_scale_inv"][:, 2:4])
    e = "model.layers.1.mlp.experts."
    w13_s, w2_s = rank[e + "w13_weight_scale_inv"], rank[e + "w2_weight_scale_inv"]
    assert bits_equal(w13_s[5, 0:1], ckpt[e + "5.gate_proj.weight_scale_inv"][1:2])
    assert bits_equal(w13_s[5, 1:2], ckpt[e + "5.up_proj.weight_scale_inv"][1:2])
    assert bits_equal(w2_s[5], ckpt[e + "5.down_proj.weight_scale_inv"][:, 1:2])
    assert bits_equal(rank[e + "w2_weight"].data[5], ckpt[e + "5.down_proj.weight"][:, BLOCK:])


@pytest.mark.parametrize(
    ("model", "engine", "message"),
    [
        ("qwen3-moe-fp8-tiny", "tp=4", r"self_attn\.qkv_proj q/k/v partition is 64 per rank"),
        ("deepseek-v3-fp8-tiny", "tp=4", r"self_attn\.o_proj input columns is 64 per rank"),
        ("qwen3-moe-tiny", "tp=1", r"self_attn\.qkv_proj q/k/v partition is 64 per rank"),
        ("kimi-k2-tiny", "tp=1", r"self_attn\.fused_qkv_a_proj fused output partition is 32"),
        ("qwen3-235b-a22b", "tp=8", r"mlp\.experts intermediate size is 192 per rank"),
        ("kimi-k2", "tp=32", r"mlp\.experts intermediate size is 64 per rank"),
        # kvmove's published Kimi K2 engine layout is BF16-only: vLLM's block-FP8 rule refuses its shared experts
        ("kimi-k2", "tp=32,ep=32", r"mlp\.shared_experts\.gate_up_proj fused output partition is 64 per rank"),
    ],
)
def test_splits_that_cut_blocks_are_refused(model: str, engine: str, message: str) -> None:
    cfg = with_engine_dtype(resolve_model(model), "fp8")
    layout = EngineLayout.parse(engine)
    with pytest.raises(LayoutError, match=message):
        for r in range(layout.ranks_per_replica):
            ENGINE.build(cfg, layout, layout.coord(r), layers=[cfg.num_hidden_layers - 1], device="meta")


@pytest.mark.parametrize(("model", "engine"), [("qwen3-235b-a22b", "tp=8,ep=8"), ("kimi-k2", "tp=16,ep=16")])
def test_published_layouts_with_expert_parallel_are_accepted(model: str, engine: str) -> None:
    cfg = with_engine_dtype(resolve_model(model), "fp8")
    layout = EngineLayout.parse(engine)
    model_ = ENGINE.build(cfg, layout, layout.coord(layout.ranks_per_replica - 1), layers=[3], device="meta")
    assert any(n.endswith("w13_weight_scale_inv") for n, _ in model_.named_parameters())


def test_loading_the_wrong_checkpoint_is_refused() -> None:
    fp8 = resolve_model("qwen3-moe-fp8-tiny")  # its config's quantization_config: block FP8
    bf16 = with_engine_dtype(fp8, "bf16")
    layout = EngineLayout.parse("tp=1")
    full = seeded_checkpoint(bf16, seed=0)
    with pytest.raises(ValueError, match="FP8 engine loads the FP8 checkpoint"):
        ENGINE.load_weights(ENGINE.build(fp8, layout, layout.coord(0)), full.items())
    with pytest.raises(ValueError, match="FP8 engine loads the FP8 checkpoint"):
        ENGINE.load_weights(ENGINE.build(bf16, layout, layout.coord(0)), engine_checkpoint(fp8, full).items())


def test_quantized_names_follow_the_published_checkpoints() -> None:
    assert is_block_quantized("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")
    assert is_block_quantized("model.layers.3.mlp.experts.17.down_proj.weight")
    assert is_block_quantized("model.layers.3.mlp.shared_experts.up_proj.weight")
    for kept in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.3.self_attn.q_a_layernorm.weight",
        "model.layers.3.self_attn.q_proj.bias",
    ):
        assert not is_block_quantized(kept), kept
