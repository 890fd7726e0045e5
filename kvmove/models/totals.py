"""What ``kvmove models show`` reports: a model's exact totals, from one tensor table per layer kind."""

from __future__ import annotations

from typing import NamedTuple

from kvmove.models.config import ModelConfig
from kvmove.models.roles import families_of
from kvmove.models.table import hf_tensors, is_moe_layer, layer_kind, layer_tensors


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
        kind = layer_kind(cfg, i)
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
    moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers))
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
