"""Checkpoints of the published figures that are not kvmove presets, as their public HF configs state them.

GLM-4.5-Air's architecture (Glm4MoeForCausalLM) is not one kvmove reads; its tensors are reproduced with a
Qwen3-MoE-shaped config of the same dimensions (attention bias, no QK norm, one shared expert, first layer dense),
its MTP layer left out. DeepSeek-V3.1 has DeepSeek-V3's shapes; its MTP layer is left out too.
"""

from __future__ import annotations

from typing import Any

from kvmove.models import ModelConfig, resolve_model
from kvmove.models.config import config_from_dict

SOURCES = {
    "qwen3-30b-a3b": "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
    "glm-4.5-air": "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json",
    "deepseek-v3.1": "https://huggingface.co/deepseek-ai/DeepSeek-V3.1/blob/main/config.json",
}

_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "glm-4.5-air": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": True,
        "qk_norm": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "n_shared_experts": 1,
        "mlp_only_layers": [0],
        "vocab_size": 151552,
        "tie_word_embeddings": False,
    },
    "deepseek-v3.1": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
    },
}


def sim_model(name: str) -> ModelConfig:
    """A kvmove preset or path (``kvmove.models.resolve_model``), or one of the configs above."""
    if name in _CONFIGS:
        return config_from_dict(_CONFIGS[name], name)
    return resolve_model(name)
