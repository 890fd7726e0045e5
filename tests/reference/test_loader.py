from __future__ import annotations

import pytest
import torch

from kvmove.models import hf_tensors, resolve_model
from kvmove.models.layout import EngineLayout
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import ReferenceModel, load_weights, rank_context


def _load(model: str, engine: str):
    cfg = resolve_model(model)
    layout = EngineLayout.parse(engine)
    layout.validate(cfg)
    full = seeded_checkpoint(cfg, seed=1)
    ranks = []
    for r in range(layout.world):
        m = ReferenceModel(cfg, rank_context(cfg, layout, layout.coord(r)))
        loaded = load_weights(m, full.items())
        assert loaded == {n for n, _ in m.named_parameters()}, "every parameter receives data"
        ranks.append(dict(m.named_parameters()))
    return cfg, full, ranks


def test_qkv_fusion_and_kv_replication_when_tp_exceeds_kv_heads() -> None:
    cfg, full, ranks = _load("qwen3-moe-tiny", "tp=4")  # 4 heads, 2 KV heads: each KV head on 2 ranks
    d = cfg.head_dim
    q = full["model.layers.0.self_attn.q_proj.weight"]
    k = full["model.layers.0.self_attn.k_proj.weight"]
    v = full["model.layers.0.self_attn.v_proj.weight"]
    for r, params in enumerate(ranks):
        qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape == (3 * d, cfg.hidden_size)
        kv_head = r // 2
        assert torch.equal(qkv[:d], q[r * d : (r + 1) * d])
        assert torch.equal(qkv[d : 2 * d], k[kv_head * d : (kv_head + 1) * d])
        assert torch.equal(qkv[2 * d :], v[kv_head * d : (kv_head + 1) * d])


def test_expert_parallel_ranks_hold_whole_local_experts() -> None:
    cfg, full, ranks = _load("qwen3-moe-tiny", "tp=2,dp=2,ep=4")
    per = cfg.num_experts // 4
    inter = cfg.moe_intermediate_size
    for r, params in enumerate(ranks):
        w13 = params["model.layers.1.mlp.experts.w13_weight"]
        w2 = params["model.layers.1.mlp.experts.w2_weight"]
        assert w13.shape == (per, 2 * inter, cfg.hidden_size)
        for local in range(per):
            e = r * per + local
            assert torch.equal(w13[local, :inter], full[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
            assert torch.equal(w13[local, inter:], full[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])
            assert torch.equal(w2[local], full[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])


def test_tp_sharded_experts_reassemble() -> None:
    cfg, full, ranks = _load("qwen3-moe-tiny", "tp=2")
    inter = cfg.moe_intermediate_size // 2
    gate = torch.cat([p["model.layers.2.mlp.experts.w13_weight"][3, :inter] for p in ranks], dim=0)
    down = torch.cat([p["model.layers.2.mlp.experts.w2_weight"][3] for p in ranks], dim=1)
    assert torch.equal(gate, full["model.layers.2.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(down, full["model.layers.2.mlp.experts.3.down_proj.weight"])


def test_vocab_padding_rows_stay_zero() -> None:
    cfg = resolve_model("qwen3-tiny", {"vocab_size": 250})
    layout = EngineLayout.parse("tp=2")
    m = ReferenceModel(cfg, rank_context(cfg, layout, layout.coord(1)))
    full = seeded_checkpoint(cfg, seed=1)
    load_weights(m, full.items())
    emb = m.model.embed_tokens.weight  # padded vocab 256 -> 128 rows per rank; rank 1 loads 122
    assert emb.shape[0] == 128
    assert torch.equal(emb[:122], full["model.embed_tokens.weight"][128:])
    assert not emb[122:].any()


def test_mla_fused_qkv_a_and_tied_embeddings() -> None:
    _, full, ranks = _load("kimi-k2-tiny", "tp=2")
    fused = ranks[1]["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    want = torch.cat(
        [full["model.layers.0.self_attn.q_a_proj.weight"], full["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]]
    )
    assert torch.equal(fused, want)  # replicated, not tp-split
    _, _, ranks2 = _load("qwen2-tiny", "tp=2")
    assert torch.equal(ranks2[0]["lm_head.weight"], ranks2[0]["model.embed_tokens.weight"])


def test_pipeline_stage_skips_foreign_layers() -> None:
    _, _, ranks = _load("qwen2-tiny", "tp=1,pp=2")
    assert "model.embed_tokens.weight" in ranks[0] and "lm_head.weight" not in ranks[0]
    assert "model.layers.3.mlp.down_proj.weight" in ranks[1] and "model.layers.0.mlp.down_proj.weight" not in ranks[1]


def test_shape_mismatch_is_a_clear_error() -> None:
    cfg = resolve_model("qwen3-tiny")
    layout = EngineLayout()
    m = ReferenceModel(cfg, rank_context(cfg, layout, layout.coord(0)))
    t = hf_tensors(cfg)[1]
    with pytest.raises(ValueError, match="has dim 0"):
        load_weights(m, [(t.name, torch.zeros(t.shape[0] - 1, *t.shape[1:], dtype=torch.bfloat16))])


def test_fused_expert_checkpoints_load_gate_up_as_they_lie() -> None:
    """gpt-oss: gate_up_proj [E, h, 2I] with gate/up columns interleaved; a tp rank takes one block of column
    pairs, so its w13 rows alternate gate and up of its own intermediate units (vLLM's layout)."""
    cfg, full, ranks = _load("gpt-oss-tiny", "tp=2")
    p = "model.layers.2.mlp.experts."
    gate_up, bias = full[p + "gate_up_proj"], full[p + "gate_up_proj_bias"]
    gate, up, n = gate_up[..., ::2], gate_up[..., 1::2], 48  # transformers' GptOssExperts reads them so
    for r, params in enumerate(ranks):
        w13, w2 = params[p + "w13_weight"], params[p + "w2_weight"]
        assert w13.shape == (6, 2 * n, cfg.hidden_size) and w2.shape == (6, cfg.hidden_size, n)
        assert torch.equal(w13[:, ::2], gate[..., r * n : (r + 1) * n].transpose(1, 2))
        assert torch.equal(w13[:, 1::2], up[..., r * n : (r + 1) * n].transpose(1, 2))
        assert torch.equal(params[p + "w13_bias"], bias[:, 2 * r * n : 2 * (r + 1) * n])
        assert torch.equal(w2, full[p + "down_proj"][:, r * n : (r + 1) * n].transpose(1, 2))
        assert torch.equal(params[p + "w2_bias"], full[p + "down_proj_bias"])  # added once, after the partial sums
    assert torch.equal(ranks[1]["model.layers.0.self_attn.sinks"], full["model.layers.0.self_attn.sinks"][3:])


def test_fused_expert_checkpoints_with_gate_and_up_halves() -> None:
    """Llama 4: gate_up_proj is [gate | up] (transformers' Llama4TextExperts chunks it in two); MoE every second
    layer; with ep > 1 each rank holds whole experts."""
    _, full, ranks = _load("llama4-tiny", "tp=2")
    p, n = "model.layers.1.feed_forward.experts.", 40
    gate, up = full[p + "gate_up_proj"].chunk(2, dim=-1)
    for r, params in enumerate(ranks):
        w13 = params[p + "w13_weight"]
        assert torch.equal(w13[:, :n], gate[..., r * n : (r + 1) * n].transpose(1, 2))
        assert torch.equal(w13[:, n:], up[..., r * n : (r + 1) * n].transpose(1, 2))
        assert "model.layers.0.feed_forward.gate_up_proj.weight" in params  # a dense layer: gate/up stacked
    _, full, ranks = _load("llama4-tiny", "tp=1,dp=2,ep=2")
    for r, params in enumerate(ranks):
        mine = slice(3 * r, 3 * (r + 1))
        assert torch.equal(params[p + "w13_weight"], full[p + "gate_up_proj"][mine].transpose(1, 2))
        assert torch.equal(params[p + "w2_weight"], full[p + "down_proj"][mine].transpose(1, 2))
