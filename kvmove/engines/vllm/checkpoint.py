"""Model directories a vLLM engine starts from: HF config.json, a tokenizer trained here, optional weights.

No hub access exists on these machines, so the tokenizer is a small byte-level BPE trained with ``tokenizers``
on a fixed text (deterministic, at most ``vocab_size`` tokens). Weights, when written, are exactly the tensors
``kvmove.models.tensors.hf_tensors`` lists, in bf16 safetensors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig

MODEL_TYPES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
SPECIALS = ["<pad>", "<bos>", "<eos>"]
_TEXT = "the a of to and in is it that was for on are with as his they be at one have this from or had by hot"


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of ``cfg`` as transformers and vLLM read it."""
    if cfg.architecture not in MODEL_TYPES:
        raise KvmoveError(f"no vLLM model type known for architecture {cfg.architecture} (known: {list(MODEL_TYPES)})")
    skip = {"name", "architecture", "extra", "qk_norm"}
    out: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items() if v is not None}
    out |= dict(cfg.extra)
    if cfg.engine_dtype == "bf16":  # an FP8 model served in BF16 (--engine-dtype bf16): vLLM must not quantize
        out.pop("quantization_config", None)
    if cfg.architecture == "DeepseekV3ForCausalLM":  # kvmove's num_experts is DeepSeek's n_routed_experts
        out["n_routed_experts"] = out.pop("num_experts")
    out |= {
        "architectures": [cfg.architecture],
        "model_type": MODEL_TYPES[cfg.architecture],
        "max_position_embeddings": out.get("max_position_embeddings", 512),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens, trained on a fixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = _TEXT.split()
    text = [" ".join(words[i % 20 :] + words[: i % 20]) for i in range(400)]
    alphabet = pre_tokenizers.ByteLevel.alphabet() if vocab_size > 256 + len(SPECIALS) else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(text, trainer)
    if tok.get_vocab_size() > vocab_size:
        raise KvmoveError(f"tokenizer has {tok.get_vocab_size()} tokens, more than the model's {vocab_size}")
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config | {"pad_token": "<pad>", "model_max_length": 512}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def write_model_dir(cfg: ModelConfig, out: Path, weights: Mapping[str, torch.Tensor] | None = None) -> Path:
    """``out`` with config.json, the tokenizer and (given ``weights``) model.safetensors; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    write_tokenizer(out, cfg.vocab_size)
    if weights is not None:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"), {"format": "pt"})
    return out
