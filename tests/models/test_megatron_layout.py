"""megatron-core's tensors: names and shapes, the import from HF (Megatron-Bridge's rules, restated here
independently), and the view-only conversion back to HF that engine plans record."""

from __future__ import annotations

import pytest
import torch

from kvmove.errors import ModelError
from kvmove.models import resolve_model
from kvmove.models.layout import TrainerLayout
from kvmove.models.megatron import MegatronLayout, vocab_padded
from kvmove.models.table import hf_tensors
from kvmove.models.weights import seeded_checkpoint
from kvmove.sync.verify import bits_equal


def _megatron(model: str, trainer: str, grouped: bool = True, **overrides: object) -> tuple:
    cfg = resolve_model(model, overrides or None)
    layout = TrainerLayout.parse(trainer)
    hf = seeded_checkpoint(cfg, seed=5)
    mlayout = MegatronLayout(grouped)
    full = {m.name: mlayout.from_hf(cfg, layout, hf.__getitem__, m) for m in mlayout.tensors(cfg, layout)}
    return cfg, layout, hf, mlayout, full


def test_names_and_shapes_are_megatron_cores() -> None:
    cfg, layout, _, mlayout, full = _megatron("qwen3-moe-tiny", "tp=2,pp=2,ep=2")
    shapes = {m.name: m.shape for m in mlayout.tensors(cfg, layout)}
    names = list(shapes)
    assert names[0] == "embedding.word_embeddings.weight" and names[-1] == "output_layer.weight"
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (qkv, cfg.hidden_size)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in shapes  # dense layer 0: norm fused into fc1
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in shapes  # MoE layers keep their own norm
    assert shapes["decoder.layers.1.mlp.experts.linear_fc1.weight7"] == (2 * cfg.moe_intermediate_size, 64)
    assert shapes["decoder.layers.1.mlp.router.weight"] == (cfg.num_experts, cfg.hidden_size)
    assert all(t.shape == full[n].shape for n, t in ((m.name, m) for m in mlayout.tensors(cfg, layout)))
    sequential = {m.name for m in MegatronLayout(grouped=False).tensors(cfg, layout)}
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight" in sequential


@pytest.mark.parametrize(
    ("trainer", "grouped"), [("tp=1", True), ("tp=2,pp=2,ep=2", True), ("tp=2,etp=2", False), ("tp=4,ep=2", True)]
)
def test_conversion_to_hf_inverts_the_import_bit_exactly(trainer: str, grouped: bool) -> None:
    cfg, layout, hf, mlayout, full = _megatron("qwen3-moe-tiny", trainer, grouped)
    back = dict(mlayout.to_hf(cfg, layout, full.items()))
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert bits_equal(back[name].contiguous(), t), name


def test_qkv_interleave_and_fc1_shards_follow_bridges_rules() -> None:
    cfg, _, hf, _, full = _megatron("qwen3-moe-tiny", "tp=2,ep=2")
    g, d = cfg.num_key_value_heads, cfg.head_dim
    n = cfg.num_attention_heads // g
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    a = "model.layers.0.self_attn."
    for group in range(g):  # [q_1..q_n, k, v] per query group
        at = group * (n + 2) * d
        assert bits_equal(qkv[at : at + n * d], hf[a + "q_proj.weight"][group * n * d : (group + 1) * n * d])
        assert bits_equal(qkv[at + n * d : at + (n + 1) * d], hf[a + "k_proj.weight"][group * d : (group + 1) * d])
        assert bits_equal(
            qkv[at + (n + 1) * d : at + (n + 2) * d], hf[a + "v_proj.weight"][group * d : (group + 1) * d]
        )
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    i = cfg.intermediate_size // 2  # tp=2: each TP shard is [gate_r; up_r]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    for r in range(2):
        shard = fc1[r * 2 * i : (r + 1) * 2 * i]
        assert bits_equal(shard[:i], gate[r * i : (r + 1) * i]) and bits_equal(shard[i:], up[r * i : (r + 1) * i])


def test_vocabulary_padding() -> None:
    cfg, _, hf, _, full = _megatron("qwen3-moe-tiny", "tp=2,ep=2", vocab_size=200)
    assert vocab_padded(cfg, 2) == 208  # 200 = 8 * 25: padded to a multiple of 8 * tp
    emb = full["embedding.word_embeddings.weight"]
    assert emb.shape == (208, cfg.hidden_size) and not emb[200:].any()
    assert bits_equal(emb[:200], hf["model.embed_tokens.weight"])
    assert vocab_padded(resolve_model("qwen3-moe-tiny"), 4) == 512  # 256 = 128 * 2: a multiple of 128 * tp


def test_tied_embeddings_and_biases_convert() -> None:
    cfg, layout, hf, mlayout, full = _megatron("qwen2-tiny", "tp=2")
    assert "output_layer.weight" not in full and "decoder.layers.0.self_attention.linear_qkv.bias" in full
    back = dict(mlayout.to_hf(cfg, layout, full.items()))
    assert all(bits_equal(back[t.name].contiguous(), hf[t.name]) for t in hf_tensors(cfg))


def test_mla_is_refused() -> None:
    with pytest.raises(ModelError, match="GQA"):
        MegatronLayout().tensors(resolve_model("kimi-k2-tiny"), TrainerLayout())


def test_conversion_is_views_of_the_megatron_tensor() -> None:
    cfg, layout, _, mlayout, full = _megatron("qwen3-moe-tiny", "tp=1")
    name = "decoder.layers.1.mlp.experts.linear_fc1.weight2"
    (gate, g), (up, u) = mlayout.to_hf(cfg, layout, [(name, full[name])])
    assert gate.endswith("experts.2.gate_proj.weight") and up.endswith("experts.2.up_proj.weight")
    base = full[name].untyped_storage().data_ptr()
    assert g.untyped_storage().data_ptr() == base == u.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([g, u]), full[name])
