"""Model vocabulary: configs, presets, parallel layouts, the HF checkpoint's tensor table and its totals.

The names below load on first use: the tensor table needs torch, and what only reads a layout or a label
(``kvmove.models.layout``: reports, plots) should not pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmove.models.config import ModelConfig, parse_overrides
    from kvmove.models.presets import DEFAULT_MODEL, preset_names, resolve_model
    from kvmove.models.table import hf_tensors, layer_tensors
    from kvmove.models.tensors import TensorMeta
    from kvmove.models.totals import ModelTotals, model_totals

_WHERE = {
    "ModelConfig": "config",
    "parse_overrides": "config",
    "DEFAULT_MODEL": "presets",
    "preset_names": "presets",
    "resolve_model": "presets",
    "hf_tensors": "table",
    "layer_tensors": "table",
    "TensorMeta": "tensors",
    "ModelTotals": "totals",
    "model_totals": "totals",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
