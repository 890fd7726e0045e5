"""The HF checkpoint's tensors (name, shape, dtype): the metadata every planner reads, and its totals."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import torch

from kvmove.models.config import ModelConfig

_LAYER_RE = re.compile(r"^(model|decoder)\.layers\.(\d+)\.")
"""Decoder layers in HF (``model.layers.N.``) and megatron-core (``decoder.layers.N.``) names."""
_EXPERT_RE = re.compile(r"\.experts\.(?:local_experts\.)?(\d+)\.|\.mlp\.experts\.linear_fc[12]\.weight(\d+)$")
"""Routed experts: HF ``mlp.experts.E.`` (Mixtral: ``block_sparse_moe.experts.E.``), megatron-core
``mlp.experts.local_experts.E.`` or grouped ``weightE``."""
_FUSED_EXPERTS_RE = re.compile(r"\.experts\.[a-z_]+$")
"""Every routed expert of a layer in one tensor: ``feed_forward.experts.gate_up_proj`` (kvmove.models.experts)."""


class TensorMeta(NamedTuple):
    """One HF tensor as a BF16 trainer holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def layer(self) -> int | None:
        return layer_of(self.name)

    @property
    def expert(self) -> int | None:
        return expert_of(self.name)

    @property
    def routed(self) -> bool:
        """Whether the tensor holds routed experts' weights (one expert's, or every expert's of a layer)."""
        return self.expert is not None or _FUSED_EXPERTS_RE.search(self.name) is not None


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(2)) if m else None


def expert_of(name: str) -> int | None:
    m = _EXPERT_RE.search(name)
    return int(m.group(1) or m.group(2)) if m else None


def with_layer(name: str, layer: int) -> str:
    """``model.layers.3.x`` -> ``model.layers.{layer}.x``; names outside layers are returned unchanged."""
    return _LAYER_RE.sub(lambda m: f"{m.group(1)}.layers.{layer}.", name, count=1)


def hf_tensors(cfg: ModelConfig, layers: Iterable[int] | None = None) -> list[TensorMeta]:
    """All tensors of the checkpoint in file order, or only those of ``layers`` plus the non-layer ones
    (the checkpoint's own description: kvmove.models.table)."""
    from kvmove.models.table import table_of

    return table_of(cfg).tensors(layers)


def layer_tensors(cfg: ModelConfig, i: int) -> list[TensorMeta]:
    """The tensors of decoder layer ``i``."""
    from kvmove.models.table import table_of

    return table_of(cfg).layer(i)


class ModelTotals(NamedTuple):
    """What ``kvmove models show`` reports."""

    name: str
    architecture: str
    num_tensors: int
    total_params: int
    total_bytes: int
    expert_params: int
    non_expert_params: int
    num_layers: int
    moe_layers: int
    megatron_families: tuple[str, ...] = ()
    """The families of kvmove.models.roles whose Megatron rules apply (empty: FSDP2/DTensor sources only)."""
    table_source: str = "config"
    """Where the tensor table came from: ``config`` (transformers' model of it) or ``checkpoint`` (headers)."""


def model_totals(cfg: ModelConfig) -> ModelTotals:
    """Exact totals, computed from one tensor table per layer kind (no full enumeration needed)."""
    count = params = nbytes = expert = 0
    kinds: dict[str, tuple[int, int, int, int]] = {}
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_kind(i)
        if kind not in kinds:
            ts = layer_tensors(cfg, i)
            kinds[kind] = (
                len(ts),
                sum(t.numel for t in ts),
                sum(t.nbytes for t in ts),
                sum(t.numel for t in ts if t.routed),
            )
        c, p, b, e = kinds[kind]
        count, params, nbytes, expert = count + c, params + p, nbytes + b, expert + e
    for t in hf_tensors(cfg, layers=()):
        count, params, nbytes = count + 1, params + t.numel, nbytes + t.nbytes
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    from kvmove.models.roles import families_of

    return ModelTotals(
        cfg.name,
        cfg.architecture,
        count,
        params,
        nbytes,
        expert,
        params - expert,
        cfg.num_hidden_layers,
        moe_layers,
        families_of(cfg),
        "checkpoint" if cfg.checkpoint else "config",
    )
