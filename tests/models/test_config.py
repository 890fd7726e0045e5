from __future__ import annotations

import json

import pytest

from kvmove.errors import ModelError
from kvmove.models import hf_tensors, model_totals, parse_overrides, preset_names, resolve_model
from kvmove.models.table import layer_kind


@pytest.mark.parametrize(
    ("model", "tensors", "params"),
    [
        # Exact totals of the published checkpoints (HF safetensors metadata).
        ("qwen3-235b-a22b", 36_945, 235_093_634_560),
        ("kimi-k2", 69_975, 1_026_408_232_448),
    ],
)
def test_full_size_totals_are_exact(model: str, tensors: int, params: int) -> None:
    totals = model_totals(resolve_model(model))
    assert totals.num_tensors == tensors
    assert totals.total_params == params
    assert totals.total_bytes == 2 * params
    assert totals.expert_params + totals.non_expert_params == params


@pytest.mark.parametrize("model", preset_names())
def test_totals_agree_with_full_enumeration(model: str) -> None:
    cfg = resolve_model(model)
    if cfg.num_experts > 16:
        cfg = resolve_model(model, {"num_hidden_layers": 3})
    tensors = hf_tensors(cfg)
    totals = model_totals(cfg)
    assert totals.num_tensors == len(tensors) == len({t.name for t in tensors})
    assert totals.total_params == sum(t.numel for t in tensors)
    assert totals.expert_params == sum(t.numel for t in tensors if t.routed)


def test_kimi_layer_kinds() -> None:
    cfg = resolve_model("kimi-k2")
    assert cfg.is_mla and cfg.num_experts == 384 and cfg.n_shared_experts == 1
    assert [layer_kind(cfg, i) for i in range(3)] == ["dense", "moe", "moe"]
    names = {t.name for t in hf_tensors(cfg, layers=[1])}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names


def test_config_json_path_and_overrides(tmp_path) -> None:
    path = tmp_path / "mymodel" / "config.json"
    path.parent.mkdir()
    path.write_text(
        json.dumps(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "hidden_size": 32,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
                "moe_intermediate_size": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "vocab_size": 100,
            }
        )
    )
    cfg = resolve_model(str(path), parse_overrides(["num_hidden_layers=2", "num_experts=8"]))
    assert cfg.name == "mymodel"
    assert cfg.num_hidden_layers == 2 and cfg.num_experts == 8
    assert cfg.head_dim == 8  # hidden / heads when head_dim is absent
    assert resolve_model(str(path.parent)).num_hidden_layers == 6


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read"),
        ("[1, 2]", "not a JSON object"),
        ('{"hidden_size": 8}', "no 'architectures'"),
        ('{"architectures": ["NoSuchModelForCausalLM"]}', "not a causal LM transformers knows"),
        ('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8}', "lacks"),
        (
            '{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8, "num_hidden_layers": "two",'
            ' "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8}',
            "must be an integer",
        ),
        (
            '{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2,'
            ' "num_attention_heads": 3, "num_key_value_heads": 2, "vocab_size": 10, "intermediate_size": 8}',
            "multiple of",
        ),
    ],
)
def test_malformed_configs_are_clear_errors(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ModelError, match=message):
        resolve_model(str(path))


def test_unknown_model() -> None:
    with pytest.raises(ModelError, match="unknown model 'llama-9000'"):
        resolve_model("llama-9000")
    with pytest.raises(ModelError, match="no such config file"):
        resolve_model("missing/config.json")


def test_bad_override() -> None:
    with pytest.raises(ModelError, match="key=value"):
        parse_overrides(["num_experts"])
    assert parse_overrides(["a=1", "b=true", "c=[1,2]", "d=text"]) == {"a": 1, "b": True, "c": [1, 2], "d": "text"}


def test_an_fp8_quantization_config_makes_an_fp8_engine(tmp_path) -> None:
    """The engine's own config says it loads block FP8 (as DeepSeek-V3's and Qwen3-*-FP8's config.json do)."""
    assert resolve_model("qwen3-moe-fp8-tiny").engine_dtype == "fp8"
    assert resolve_model("deepseek-v3-fp8-tiny").engine_dtype == "fp8"
    assert resolve_model("qwen3-moe-tiny").engine_dtype == "bf16"
    raw = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}
    raw |= {"num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 64}
    path = tmp_path / "int4" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(raw | {"quantization_config": {"quant_method": "awq", "bits": 4}}))
    with pytest.raises(ModelError, match=r"quantization_config .* is not supported"):
        resolve_model(str(path))
    path.write_text(json.dumps(raw | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}))
    with pytest.raises(ModelError, match=r"weight_block_size \[128, 128\]"):
        resolve_model(str(path))
