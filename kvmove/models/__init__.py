"""Model vocabulary: configs, presets, parallel layouts, the HF checkpoint's tensor table and its totals."""

from kvmove.models.config import ModelConfig, parse_overrides
from kvmove.models.presets import DEFAULT_MODEL, preset_names, resolve_model
from kvmove.models.table import hf_tensors, layer_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.models.totals import ModelTotals, model_totals

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
