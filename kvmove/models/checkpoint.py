"""The checkpoint an inference engine loads, per engine dtype: the BF16 HF tensors, or their block-FP8 form.

The trainer always holds the BF16 checkpoint (kvmove.models.table.hf_tensors). An engine with
``engine_dtype="fp8"`` loads what DeepSeek-V3, Kimi K2 and Qwen3-235B-A22B-FP8 publish instead: every linear
weight of attention and MLP (dense, routed and shared experts) as ``<name>.weight`` in float8_e4m3fn plus
``<name>.weight_scale_inv`` (float32, one per 128x128 block); embeddings, ``lm_head``, norms and the router
(``mlp.gate.weight``, ``e_score_correction_bias``) stay BF16. Sources: docs/notes/fp8.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from kvmove.models.config import ENGINE_DTYPES, ModelConfig
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta, layer_of
from kvmove.quant.fp8 import BLOCK, FP8_DTYPE, scale_shape
from kvmove.quant.quantizer import quantize

SCALE_SUFFIX = "_scale_inv"

# The linear layers whose weights the FP8 checkpoints quantize (the leaf module of ``...<leaf>.weight``).
_QUANTIZED_LEAVES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
)


def is_block_quantized(name: str) -> bool:
    """Whether the FP8 checkpoints store HF tensor ``name`` (a BF16 trainer name) in block FP8."""
    parts = name.split(".")
    return layer_of(name) is not None and parts[-1] == "weight" and parts[-2] in _QUANTIZED_LEAVES


def scale_name(weight: str) -> str:
    """``...down_proj.weight`` -> ``...down_proj.weight_scale_inv``."""
    return weight + SCALE_SUFFIX


def fp8_tensors(cfg: ModelConfig, layers: Iterable[int] | None = None) -> list[TensorMeta]:
    """The FP8 checkpoint's tensors: each quantized weight (e4m3fn) followed by its block scales (float32)."""
    out: list[TensorMeta] = []
    for t in hf_tensors(cfg, layers):
        if is_block_quantized(t.name):
            out.append(TensorMeta(t.name, t.shape, FP8_DTYPE))
            out.append(TensorMeta(scale_name(t.name), scale_shape(t.shape, BLOCK), torch.float32))
        else:
            out.append(t)
    return out


def quantize_checkpoint(weights: Mapping[str, torch.Tensor], *, backend: str | None = None) -> dict[str, torch.Tensor]:
    """BF16 HF tensors -> the FP8 checkpoint's tensors, each quantized whole (the engine's own quantizer)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if is_block_quantized(name):
            q = quantize(w, backend=backend, name=name)
            out[name], out[scale_name(name)] = q.weight, q.scale_inv
        else:
            out[name] = w
    return out


@dataclass(frozen=True)
class EngineFormat:
    """What an engine of one dtype holds: its loader's checkpoint, and how a BF16 checkpoint becomes it."""

    name: str
    weight_block: int | None
    """Block size of its block-FP8 linear weights; None: linear weights in the model's dtype."""
    tensors: Callable[[ModelConfig, Iterable[int] | None], list[TensorMeta]]
    convert: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


ENGINE_FORMATS: dict[str, EngineFormat] = {
    "bf16": EngineFormat("bf16", None, hf_tensors, dict),
    "fp8": EngineFormat("fp8", BLOCK, fp8_tensors, quantize_checkpoint),
}
assert tuple(ENGINE_FORMATS) == ENGINE_DTYPES


def engine_format(cfg: ModelConfig) -> EngineFormat:
    return ENGINE_FORMATS[cfg.engine_dtype]


def engine_tensors(cfg: ModelConfig, layers: Iterable[int] | None = None) -> list[TensorMeta]:
    """The tensors ``cfg``'s engine loads (what a dry run of its loader records), in file order."""
    return engine_format(cfg).tensors(cfg, layers)


def engine_checkpoint(cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full BF16 checkpoint ``weights`` as ``cfg``'s engine would load it from disk."""
    return engine_format(cfg).convert(weights)


def with_engine_dtype(cfg: ModelConfig, engine_dtype: str) -> ModelConfig:
    """``cfg`` served by an engine holding ``engine_dtype`` weights (ModelError for unknown dtypes)."""
    return dataclasses.replace(cfg, engine_dtype=engine_dtype)
