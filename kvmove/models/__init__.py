"""Model vocabulary: configs, presets and the HF checkpoint's tensor table."""

from kvmove.models.config import ModelConfig, parse_overrides
from kvmove.models.presets import DEFAULT_MODEL, preset_names, resolve_model
from kvmove.models.tensors import ModelTotals, TensorMeta, hf_tensors, layer_tensors, model_totals

__all__ = [
    "DEFAULT_MODEL",
    "ModelConfig",
    "ModelTotals",
    "TensorMeta",
    "hf_tensors",
    "layer_tensors",
    "model_totals",
    "parse_overrides",
    "preset_names",
    "resolve_model",
]
