"""``load_weights``: HF-named tensors into the reference model's fused parameters, as engine loaders do it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from kvmove.engines.reference.layers import default_weight_loader
from kvmove.models.config import ModelConfig


class LoadableModel(Protocol):
    """What the loader needs of a model (``ReferenceModel`` is one; it calls this loader from its own method)."""

    config: ModelConfig

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


# (fused parameter, HF piece, shard id): the pieces an engine fuses into one parameter.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
    (".fused_qkv_a_proj.", ".q_a_proj.", 0),
    (".fused_qkv_a_proj.", ".kv_a_proj_with_mqa.", 1),
)

_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<kind>weight(_scale_inv)?)$"
)
_EXPERT_SHARD = {"gate": ("w13", "w1"), "up": ("w13", "w3"), "down": ("w2", "w2")}


def load_weights(model: LoadableModel, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load HF tensors; names this rank does not hold (other stages, foreign experts) are skipped.

    Returns the names of the parameters that received data.
    """
    params = dict(model.named_parameters())
    names = set(params)
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        for name in _targets(model, hf_name):
            param_name = _load_one(params, names, name, tensor)
            if param_name is not None:
                loaded.add(param_name)
    return loaded


def _targets(model: LoadableModel, hf_name: str) -> list[str]:
    if hf_name == "model.embed_tokens.weight" and model.config.tie_word_embeddings:
        return [hf_name, "lm_head.weight"]
    return [hf_name]


def _load_one(params: dict[str, nn.Parameter], names: set[str], name: str, w: torch.Tensor) -> str | None:
    """Load one HF tensor; return the parameter it landed in, or None when this rank does not hold it."""
    m = _EXPERT.match(name)
    if m:
        param_name = f"{m['prefix']}.{_EXPERT_SHARD[m['proj']][0]}_{m['kind']}"
        if param_name not in names:
            return None  # this rank does not hold the layer
        param = params[param_name]
        expert_shard = _EXPERT_SHARD[m["proj"]][1]
        held = param.weight_loader(param, w, shard_id=expert_shard, expert_id=int(m["expert"]))  # type: ignore[attr-defined]
        return param_name if held else None
    for fused_part, piece, shard_id in STACKED_PARAMS:
        if piece not in name:
            continue
        param_name = name.replace(piece, fused_part)
        if param_name not in names:
            break  # not fused on this model: load by its own name below
        param = params[param_name]
        param.weight_loader(param, w, shard_id)  # type: ignore[attr-defined]
        return param_name
    if name not in names:
        return None
    param = params[name]
    getattr(param, "weight_loader", default_weight_loader)(param, w)
    return name
