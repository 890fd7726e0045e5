"""Model directories transformers and vLLM start from: HF config.json, a tokenizer trained here, optional weights.

No hub access exists on these machines, so the tokenizer is a small byte-level BPE trained with ``tokenizers``
on a fixed text (deterministic, at most ``vocab_size`` tokens). Weights, when written, are exactly the tensors
``kvmove.models.table.hf_tensors`` lists, in bf16 safetensors. Any architecture transformers knows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvmove.errors import KvmoveError
from kvmove.models.config import NOT_HF, ModelConfig, hf_dict
from kvmove.models.hf import model_type_of, quiet_transformers

SPECIALS = ["<pad>", "<bos>", "<eos>"]
_TEXT = "the a of to and in is it that was for on are with as his they be at one have this from or had by hot"


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of ``cfg`` as transformers and vLLM read it, for any architecture transformers knows: the
    config it came from (kvmove.models.config.hf_dict), plus every field of ours the architecture's config class
    has (so a default of ours, such as a preset's ``norm_topk_prob``, is stated rather than left to another's)."""
    from transformers import AutoConfig

    out = hf_dict(cfg)
    model_type = model_type_of(cfg.architecture, out.get("model_type"))
    with quiet_transformers():
        defaults = AutoConfig.for_model(model_type)
    spelled = dict(cfg.spelling)
    for f in dataclasses.fields(cfg):
        key, value = spelled.get(f.name, f.name), getattr(cfg, f.name)
        if f.name not in NOT_HF and key not in out and value is not None and hasattr(defaults, key):
            out[key] = list(value) if isinstance(value, tuple) else value
    out |= {"architectures": [cfg.architecture], "model_type": model_type, "torch_dtype": "bfloat16"}
    out.setdefault("max_position_embeddings", 512)
    out.setdefault("hidden_act", "silu")
    out |= {"bos_token_id": 1, "eos_token_id": 2}
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
