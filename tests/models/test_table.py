"""The tensor table from the checkpoint's own description: transformers' meta model and conversion mapping for a
config, the safetensors headers for a checkpoint directory; both agree, and a mismatch is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kvmove.errors import ModelError, PlanError
from kvmove.models import model_totals, resolve_model
from kvmove.models.layout import TrainerLayout
from kvmove.models.presets import preset_raw
from kvmove.models.roles import families_of
from kvmove.models.table import header_table, hf_tensors, layer_kind, table_of
from kvmove.sync.planning.ownership import Ownership, shard_rule
from kvmove.sync.planning.plan import Box

FUSED = ["gpt-oss-tiny", "llama4-tiny"]
"""Presets whose checkpoints hold every expert of a layer in one tensor per projection."""


def save_checkpoint(model: str, out: Path, drop: str | None = None) -> Path:
    """A real transformers checkpoint of preset ``model`` (save_pretrained: per-expert tensors on disk)."""
    from kvmove.sync.sources.tiny_trainer import hf_model

    cfg = resolve_model(model)
    m = hf_model(cfg, seed=0)
    m.save_pretrained(str(out))
    if drop is not None:
        from safetensors.torch import load_file, save_file

        path = out / "model.safetensors"
        tensors = {k: v for k, v in load_file(str(path)).items() if k != drop}
        save_file(tensors, str(path), {"format": "pt"})
    return out


def test_per_expert_names_come_from_transformers_conversion_mapping() -> None:
    names = {t.name: t.shape for t in hf_tensors(resolve_model("mixtral-tiny"))}
    # transformers 5 holds Mixtral's experts fused (mlp.experts.gate_up_proj); its checkpoints per expert
    assert names["model.layers.2.block_sparse_moe.experts.5.w1.weight"] == (80, 96)
    assert names["model.layers.2.block_sparse_moe.experts.5.w2.weight"] == (96, 80)
    assert names["model.layers.0.block_sparse_moe.gate.weight"] == (6, 96)
    assert not any("gate_up_proj" in n for n in names)


def test_layer_kinds_and_tied_embeddings_read_off_the_table() -> None:
    glm = resolve_model("glm4-moe-tiny")
    assert [layer_kind(glm, i) for i in range(3)] == ["dense", "moe", "moe"]
    names = {t.name for t in hf_tensors(glm)}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names
    gemma = {t.name for t in hf_tensors(resolve_model("gemma2-tiny"))}
    assert "lm_head.weight" not in gemma and "model.layers.0.pre_feedforward_layernorm.weight" in gemma


@pytest.mark.parametrize("model", ["mixtral-tiny", "gemma2-tiny", "qwen3-moe-tiny", *FUSED])
def test_headers_of_a_saved_checkpoint_equal_the_config_table(tmp_path: Path, model: str) -> None:
    out = save_checkpoint(model, tmp_path / model)
    from_headers = {t.name: t.shape for t in header_table(out).tensors()}
    assert from_headers == {t.name: t.shape for t in hf_tensors(resolve_model(model))}
    cfg = resolve_model(str(out))
    assert cfg.checkpoint is not None and model_totals(cfg).table_source == "checkpoint"
    assert model_totals(cfg).total_params == model_totals(resolve_model(model)).total_params


def test_a_checkpoint_whose_tensors_do_not_tile_is_refused(tmp_path: Path) -> None:
    missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    out = save_checkpoint("mixtral-tiny", tmp_path / "ckpt", drop=missing)
    with pytest.raises(ModelError, match="lacks tensor " + re.escape(missing)):
        table_of(resolve_model(str(out)))


def test_an_architecture_transformers_does_not_know_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**preset_raw("llama3-tiny"), "architectures": ["LlamaXForCausalLM"]}))
    with pytest.raises(ModelError, match="'LlamaXForCausalLM' is not a causal LM transformers knows"):
        resolve_model(str(path))


@pytest.mark.parametrize(
    ("model", "families"),
    [
        ("llama3-tiny", ("gqa-dense",)),
        ("gemma2-tiny", ("gqa-dense",)),
        ("mixtral-tiny", ("gqa-moe",)),
        ("glm4-moe-tiny", ("gqa-moe",)),
        ("kimi-k2-tiny", ("mla-moe",)),
        ("gpt-oss-tiny", ("gqa-fused-moe",)),
        ("llama4-tiny", ("gqa-fused-moe",)),
    ],
)
def test_megatron_rule_families(model: str, families: tuple[str, ...]) -> None:
    cfg = resolve_model(model)
    assert families_of(cfg) == families
    layout = TrainerLayout.parse("tp=2,pp=3,ep=2") if cfg.is_moe else TrainerLayout.parse("tp=2,pp=3")
    for t in hf_tensors(cfg):  # every tensor is classified
        shard_rule(cfg, layout, t.name)


def test_mixtral_experts_split_over_etp_and_router_replicated() -> None:
    cfg = resolve_model("mixtral-tiny")
    layout = TrainerLayout.parse("tp=2,ep=2,etp=2")
    w1 = shard_rule(cfg, layout, "model.layers.1.block_sparse_moe.experts.4.w1.weight")
    w2 = shard_rule(cfg, layout, "model.layers.1.block_sparse_moe.experts.4.w2.weight")
    gate = shard_rule(cfg, layout, "model.layers.1.block_sparse_moe.gate.weight")
    assert (w1.dim, w1.group, w1.expert) == (0, "etp", 4) and (w2.dim, w2.group) == (1, "etp")
    assert gate.dim is None


def test_fused_experts_split_over_ep_on_dim_0_and_over_etp_on_their_intermediate_dim() -> None:
    cfg = resolve_model("gpt-oss-tiny")  # gate_up_proj [6, 96, 192] (gate/up interleaved), down_proj [6, 96, 96]
    layout = TrainerLayout.parse("tp=2,ep=2,etp=2")
    rules = {leaf: shard_rule(cfg, layout, f"model.layers.1.mlp.experts.{leaf}") for leaf in FUSED_LEAVES}
    assert {leaf: (r.fused, r.dim, r.group) for leaf, r in rules.items()} == {
        "gate_up_proj": (True, 2, "etp"),  # output columns
        "gate_up_proj_bias": (True, 1, "etp"),
        "down_proj": (True, 1, "etp"),  # input rows
        "down_proj_bias": (True, None, "etp"),  # added after the reduction: whole on every ETP rank
    }
    attn = {leaf: shard_rule(cfg, layout, f"model.layers.1.self_attn.{leaf}").dim for leaf in ATTN_LEAVES}
    assert attn == {"sinks": 0, "q_proj.bias": 0, "o_proj.weight": 1, "o_proj.bias": None}
    assert shard_rule(cfg, layout, "model.layers.1.mlp.router.bias").dim is None
    # rank 3 is EP rank 1, ETP rank 1: experts 3..5, columns 96..191 (intermediate units 48..95, gate and up)
    own = Ownership(cfg, layout)
    by_name = {t.name: t for t in hf_tensors(cfg)}
    boxes = {leaf: dict(own.slices(by_name[f"model.layers.1.mlp.experts.{leaf}"]))[3] for leaf in FUSED_LEAVES}
    assert boxes["gate_up_proj"] == Box((3, 0, 96), (6, 96, 192))
    assert boxes["down_proj"] == Box((3, 48, 0), (6, 96, 96))
    assert boxes["down_proj_bias"] == Box((3, 0), (6, 96))


FUSED_LEAVES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
ATTN_LEAVES = ("sinks", "q_proj.bias", "o_proj.weight", "o_proj.bias")


def test_an_etp_split_of_gate_and_up_halves_is_refused() -> None:
    """Llama 4's gate_up_proj is [gate | up]: an ETP rank holds a block of each half, two blocks of the tensor."""
    cfg = resolve_model("llama4-tiny")
    Ownership(cfg, TrainerLayout.parse("tp=2,ep=2"))  # etp=1: whole experts, one block per rank
    with pytest.raises(PlanError, match=r"two halves of model\.layers\.1\.feed_forward\.experts\.gate_up_proj.*etp=1"):
        Ownership(cfg, TrainerLayout.parse("tp=2,ep=2,etp=2"))


def test_a_split_that_does_not_divide_a_tensor_is_refused_by_name() -> None:
    pattern = r"etp=3 does not divide dim 2 \(160\) of tensor model\.layers\.0\.mlp\.experts\.gate_up_proj "
    with pytest.raises(PlanError, match=pattern):
        Ownership(resolve_model("gpt-oss-tiny", {"intermediate_size": 80}), TrainerLayout.parse("tp=1,etp=3"))


def test_a_tensor_no_megatron_rule_classifies_is_refused_by_name() -> None:
    cfg = resolve_model("llama3-tiny")
    with pytest.raises(PlanError, match=r"family gqa-dense classifies tensor model\.layers\.0\.self_attn\.sinks"):
        shard_rule(cfg, TrainerLayout.parse("tp=2"), "model.layers.0.self_attn.sinks")


def test_overridden_configs_describe_their_own_tensors() -> None:
    cfg = resolve_model("mixtral-tiny", {"num_local_experts": 4, "num_hidden_layers": 2})
    names = [t.name for t in hf_tensors(cfg)]
    assert cfg.num_experts == 4 and "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    assert not any(".experts.4." in n or ".layers.2." in n for n in names)
    assert torch.bfloat16 == hf_tensors(cfg)[0].dtype
