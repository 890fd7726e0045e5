"""One weight update's commit into a live vLLM model: process the staged modules, then copy, all or nothing.

:func:`prepare` runs vLLM's post-load processing for every module that owns an updated staging parameter,
on that staging module with copies of its parameters swapped in (the staging module is restored afterwards,
so it keeps the unprocessed values later partial updates build on). The live model is not touched, so a
failure anywhere leaves it as it was. :func:`commit` then copies each processed tensor into the live
parameter's storage (addresses never change) and rebinds what processing bound on the module (on CPU the
linear kernel closure holding the oneDNN-packed weight). Commit only copies tensors whose shapes and dtypes
:func:`prepare` checked, so it cannot fail half way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

_MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules", "training"})
_DONE_FLAG = "_already_called_process_weights_after_loading"


class ModuleUpdate(NamedTuple):
    """One live module's processed values, ready to commit."""

    name: str
    module: nn.Module
    tensors: dict[str, torch.Tensor]
    """Processed values by parameter name, one per live parameter of the module."""
    state: dict[str, Any]
    """Attributes processing bound on the module (kernel closures and the like), to rebind on the live one."""


def owners(staging: nn.Module, params: Iterable[str]) -> list[str]:
    """Names of the staging modules holding any of ``params`` (a tied parameter has several owners)."""
    by_name = dict(staging.named_parameters())
    wanted = {id(by_name[p]) for p in params}
    return [
        name
        for name, module in staging.named_modules()
        if any(id(p) in wanted for p in module._parameters.values() if p is not None)
    ]


def prepare(live: nn.Module, staging: nn.Module, modules: Iterable[str], vllm_config: Any) -> list[ModuleUpdate]:
    """Processed values of ``modules`` (names in both models) from the staging model; the live one is untouched."""
    from vllm.config import set_current_vllm_config

    live_modules, staged = dict(live.named_modules()), dict(staging.named_modules())
    with set_current_vllm_config(vllm_config), torch.no_grad():
        return [_processed(name, staged[name], live_modules[name]) for name in modules]


def commit(updates: Iterable[ModuleUpdate]) -> None:
    """Copy every prepared tensor into its live parameter and rebind the prepared module state."""
    with torch.no_grad():
        for update in updates:
            for pname, value in update.tensors.items():
                getattr(update.module, pname).data.copy_(value)
            for attr, value in update.state.items():
                setattr(update.module, attr, value)


def _processed(name: str, source: nn.Module, live: nn.Module) -> ModuleUpdate:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(source, "quant_method", None)
    kernel = {k: v for k, v in live._parameters.items() if v is not None}
    if not isinstance(method, QuantizeMethodBase):  # norms and the like: the staged values are the live ones
        update = ModuleUpdate(name, live, {k: getattr(source, k).data for k in kernel}, {})
    else:
        update = _hosted(name, source, method, live, kernel)
    for pname, value in update.tensors.items():
        want = kernel[pname]
        if value.shape != want.shape or value.dtype != want.dtype:
            raise RuntimeError(
                f"kvmove: {name}.{pname}: processing made {tuple(value.shape)} {value.dtype}, the live engine "
                f"holds {tuple(want.shape)} {want.dtype}; nothing was changed"
            )
    return update


def _hosted(name: str, source: nn.Module, method: Any, live: nn.Module, kernel: dict[str, Any]) -> ModuleUpdate:
    """Run ``method``'s processing on ``source`` with copies of its parameters, harvest, restore ``source``."""
    saved, params, buffers = dict(source.__dict__), dict(source._parameters), dict(source._buffers)
    saved_method = dict(method.__dict__)
    try:
        for pname, p in params.items():
            if p is not None:
                fresh = nn.Parameter(p.data.clone(), requires_grad=False)
                fresh.__dict__.update(p.__dict__)  # weight_loader, output_dim, ... as the loader left them
                source._parameters[pname] = fresh
        if hasattr(method, "moe_kernel"):
            method.moe_kernel = None  # a first load's processing (with the CPU prepack), not a re-run's
        source.__dict__.pop(_DONE_FLAG, None)
        method.process_weights_after_loading(source)
        missing = [k for k in kernel if not isinstance(getattr(source, k, None), torch.Tensor)]
        if missing:
            raise RuntimeError(f"kvmove: {name}: processing left no {missing}; nothing was changed")
        tensors = {k: getattr(source, k).data for k in kernel}
        state = {
            k: v for k, v in source.__dict__.items() if k not in _MODULE_SLOTS and (k not in saved or saved[k] is not v)
        }
        return ModuleUpdate(name, live, tensors, state)
    finally:
        source.__dict__.clear()
        source.__dict__.update(saved)
        source._parameters.clear()
        source._parameters.update(params)
        source._buffers.clear()
        source._buffers.update(buffers)
        method.__dict__.clear()
        method.__dict__.update(saved_method)
