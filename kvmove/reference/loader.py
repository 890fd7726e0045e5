"""``load_weights``: HF-named tensors into the reference model's fused parameters, routed by the declarative
mapping (kvmove.reference.mapping) as engine loaders route them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from kvmove.models.config import ModelConfig
from kvmove.reference.layers import default_weight_loader
from kvmove.reference.mapping import EXPERT_NAME, EXPERT_PARAMS, TIED, fused_expert_of, stacked_of


class LoadableModel(Protocol):
    """What the loader needs of a model (``ReferenceModel`` is one; it calls this loader from its own method)."""

    config: ModelConfig

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


def load_weights(model: LoadableModel, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load HF tensors; names this rank does not hold (other stages, foreign experts) are skipped.

    Returns the names of the parameters that received data.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        for name in _targets(model, hf_name):
            param_name = _load_one(params, name, tensor)
            if param_name is not None:
                loaded.add(param_name)
    return loaded


def _targets(model: LoadableModel, hf_name: str) -> list[str]:
    if hf_name == TIED[0] and getattr(model, "tied", False):
        return [hf_name, TIED[1]]
    return [hf_name]


def _load_one(params: dict[str, nn.Parameter], name: str, w: torch.Tensor) -> str | None:
    """Load one HF tensor; return the parameter it landed in, or None when this rank does not hold it."""
    m = EXPERT_NAME.match(name)
    if m and m["proj"] in EXPERT_PARAMS:
        shard = EXPERT_PARAMS[m["proj"]]
        param_name = f"{m['prefix']}.{'w2' if shard == 'w2' else 'w13'}_{m['kind']}"
        if param_name not in params:
            return None  # this rank does not hold the layer
        param = params[param_name]
        held = param.weight_loader(param, w, shard_id=shard, expert_id=int(m["expert"]))  # type: ignore[attr-defined]
        return param_name if held else None
    every = fused_expert_of(name)  # a tensor of every expert of the layer
    if every is not None:
        param_name = f"{every.prefix}.{every.target.param}"
        if param_name not in params:
            return None  # this rank does not hold the layer
        params[param_name].weight_loader(params[param_name], w, every.target.shard)  # type: ignore[attr-defined]
        return param_name
    path, _, leaf = name.rpartition(".")
    parent, _, module = path.rpartition(".")
    rule = stacked_of(module)
    if rule is not None and (fused := f"{parent}.{rule.fused}.{leaf}") in params:
        param = params[fused]
        param.weight_loader(param, w, rule.shard)  # type: ignore[attr-defined]
        return fused
    if name not in params:
        return None
    param = params[name]
    getattr(param, "weight_loader", default_weight_loader)(param, w)
    return name
