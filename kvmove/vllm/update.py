"""One commit unit of a weight update into a live vLLM model: process each module from its staged tensors, commit.

vLLM's post-load processing runs on the *live* module hosting the staged (unprocessed) tensors: fresh parameters
over them, carrying the attributes vLLM's loader gave the unprocessed parameters (from the meta-device model the
plan was recorded on), swapped in for the processing and swapped out again (:func:`process_module`), so the live
module is as it was until :func:`commit` copies each processed tensor into the live parameter's storage
(addresses never change) and rebinds what processing bound on the module (on CPU the linear kernel closure
holding the oneDNN- or sgl-packed weight). Processing that keeps a staged tensor inside a kernel closure (not a
parameter) gets a copy of it instead, since the window slot is reused by the next unit.

:func:`fill_unit` rebuilds a unit's unprocessed values from the live model, for an update carrying only part of
a fused parameter: a parameter processing keeps as it was is copied; a linear's weight that processing packed is
read back from its kernel (kvmove.vllm.verify.read_back, bit-exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from kvmove.vllm.verify import linear_modules, read_back

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

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors.values())


def owners(model: nn.Module, params: Iterable[str]) -> dict[str, dict[str, str]]:
    """Module name -> (its local parameter name -> the model's parameter name) for every module of ``model`` (the
    unprocessed meta model) holding one of ``params`` (a tied parameter has several owners)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    wanted = set(params)
    out: dict[str, dict[str, str]] = {}
    for mname, module in model.named_modules():
        local = {k: name_of[id(p)] for k, p in module._parameters.items() if p is not None and id(p) in name_of}
        if any(full in wanted for full in local.values()):
            out[mname] = local
    return out


def process_module(
    name: str, live: nn.Module, meta: nn.Module, staged: Mapping[str, torch.Tensor], vllm_config: Any
) -> ModuleUpdate:
    """Processed values of module ``name`` from ``staged`` (local parameter name -> unprocessed tensor); the live
    module is left as it was."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(live, "quant_method", None)
    kernel = {k: v for k, v in live._parameters.items() if v is not None}
    with set_current_vllm_config(vllm_config), torch.no_grad():
        if not isinstance(method, QuantizeMethodBase):  # norms and the like: the staged values are the live ones
            update = ModuleUpdate(name, live, {k: staged[k] for k in kernel}, {})
        else:
            update = _hosted(name, live, method, meta, staged, kernel, copy=False)
            if _captures(update.state, staged.values()):
                update = _hosted(name, live, method, meta, staged, kernel, copy=True)
    for pname, value in update.tensors.items():
        want = kernel[pname]
        if value.shape != want.shape or value.dtype != want.dtype:
            raise RuntimeError(
                f"kvmove: {name}.{pname}: processing made {tuple(value.shape)} {value.dtype}, the live engine "
                f"holds {tuple(want.shape)} {want.dtype}"
            )
    return update


def commit(updates: Iterable[ModuleUpdate]) -> None:
    """Copy every prepared tensor into its live parameter and rebind the prepared module state."""
    with torch.no_grad():
        for update in updates:
            for pname, value in update.tensors.items():
                getattr(update.module, pname).data.copy_(value)
            for attr, value in update.state.items():
                setattr(update.module, attr, value)


def _hosted(
    name: str,
    live: nn.Module,
    method: Any,
    meta: nn.Module,
    staged: Mapping[str, torch.Tensor],
    kernel: dict[str, Any],
    copy: bool,
) -> ModuleUpdate:
    """Run ``method``'s processing on ``live`` hosting ``staged``; harvest; restore ``live`` as it was."""
    saved, params, buffers = dict(live.__dict__), dict(live._parameters), dict(live._buffers)
    saved_method = dict(method.__dict__)
    try:
        for pname, p in meta._parameters.items():
            if p is None:
                continue
            data = staged[pname].clone() if copy else staged[pname]
            fresh = nn.Parameter(data, requires_grad=False)
            fresh.__dict__.update(p.__dict__)  # weight_loader, output_dim, ... as the loader left them
            live._parameters[pname] = fresh
        if hasattr(method, "moe_kernel"):
            method.moe_kernel = None  # a first load's processing (with the CPU prepack), not a re-run's
        live.__dict__.pop(_DONE_FLAG, None)
        method.process_weights_after_loading(live)
        missing = [k for k in kernel if not isinstance(getattr(live, k, None), torch.Tensor)]
        if missing:
            raise RuntimeError(f"kvmove: {name}: processing left no {missing}")
        tensors = {k: getattr(live, k).data for k in kernel}
        state = {
            k: v for k, v in live.__dict__.items() if k not in _MODULE_SLOTS and (k not in saved or saved[k] is not v)
        }
        return ModuleUpdate(name, live, tensors, state)
    finally:
        live.__dict__.clear()
        live.__dict__.update(saved)
        live._parameters.clear()
        live._parameters.update(params)
        live._buffers.clear()
        live._buffers.update(buffers)
        method.__dict__.clear()
        method.__dict__.update(saved_method)


def _captures(state: Mapping[str, Any], staged: Iterable[torch.Tensor]) -> bool:
    """Whether a closure or default argument of the harvested state holds one of the ``staged`` storages."""
    ptrs = {t.untyped_storage().data_ptr() for t in staged}
    for value in state.values():
        cells = [c.cell_contents for c in (getattr(value, "__closure__", None) or ()) if c.cell_contents is not None]
        held = [*cells, *(getattr(value, "__defaults__", None) or ())]
        if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in ptrs for t in held):
            return True
    return False


def live_value(live: nn.Module, module: str, local: str, shape: torch.Size) -> torch.Tensor | None:
    """The current unprocessed value of ``module.local`` read from the live model, or None where processing
    changed it beyond recovery (prepacked MoE experts, quantized weights)."""
    mod = live.get_submodule(module)
    p = mod._parameters.get(local)
    if p is not None and tuple(p.shape) == tuple(shape) and p.dtype.is_floating_point:
        method = getattr(mod, "quant_method", None)
        if method is None or type(method).__name__ in _KEEPS_PARAMETERS:
            return p.data
    if local == "weight":
        for name, linear, width in linear_modules(live):
            if name == module:
                weight = read_back(linear, width)
                return weight if tuple(weight.shape) == tuple(shape) else None
    return None


_KEEPS_PARAMETERS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
"""Quant methods whose processing leaves a parameter it keeps at its shape with its values (on CPU a linear's
bias may turn float32: the same values, and a weight it keeps is an embedding's lookup table)."""


def fill_unit(live: nn.Module, meta_owners: Mapping[str, Mapping[str, str]], views: Mapping[str, torch.Tensor]) -> None:
    """Write the live model's current unprocessed values into a unit's staged ``views`` (model parameter name ->
    view); a RuntimeError naming the first parameter that cannot be rebuilt so."""
    with torch.no_grad():
        for module, local in _homes(meta_owners, views):
            full = meta_owners[module][local]
            value = live_value(live, module, local, views[full].shape)
            if value is None:
                raise RuntimeError(
                    f"kvmove: {full} cannot be rebuilt from the live model (processing repacked it): send every "
                    "tensor of its module in the update"
                )
            views[full].copy_(value)


def _homes(meta_owners: Mapping[str, Mapping[str, str]], views: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(module, local name) of each viewed parameter, at its first owner (a tied parameter is read once)."""
    seen: set[str] = set()
    out = []
    for module, local_names in meta_owners.items():
        for local, full in local_names.items():
            if full in views and full not in seen:
                seen.add(full)
                out.append((module, local))
    return out
