"""Trainer ownership: which trainer ranks hold which slice of every HF tensor (metadata only).

``shard_rule`` states Megatron's split of each tensor; ``Ownership.slices`` gives the raw shards as the trainer
holds them (what it would all-gather), and ``Ownership.holders`` what each rank holds once a strategy's
gather scope has run (kvmove.sync.strategies): ``stage`` gathers TP (and ETP for experts) inside a pipeline
stage, ``global`` gathers everything everywhere, ``root`` gathers onto rank 0 only.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from kvmove.errors import PlanError
from kvmove.layout import TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import TensorMeta, expert_of, layer_of
from kvmove.sync.planning.plan import Box
from kvmove.sync.strategies import Gather

_COLUMN = ("q_proj.", "k_proj.", "v_proj.", "q_b_proj.", "kv_b_proj.", "gate_proj.", "up_proj.")
_ROW = ("o_proj.", "down_proj.")


class ShardRule(NamedTuple):
    """How the trainer splits one tensor: along ``dim`` over the ``group`` (None: replicated)."""

    stage: int
    dim: int | None
    group: str  # "tp" (dense, attention, shared experts) or "etp" (routed experts)
    expert: int | None


class Holding(NamedTuple):
    rank: int
    box: Box


def shard_rule(cfg: ModelConfig, layout: TrainerLayout, name: str) -> ShardRule:
    """Megatron's sharding of HF tensor ``name`` under ``layout``."""
    layer = layer_of(name)
    if layer is None:
        stage = 0 if name == "model.embed_tokens.weight" else layout.pp - 1
        dim = 0 if name in ("model.embed_tokens.weight", "lm_head.weight") else None
        return ShardRule(stage, dim, "tp", None)
    stage = _stage_of_layer(cfg.num_hidden_layers, layout.pp, layer)
    expert = expert_of(name)
    leaf = name.rsplit(".", 2)[-2] + "."
    replicated = (
        "layernorm" in name
        or "norm." in leaf
        or ".mlp.gate." in name
        or leaf
        in (
            "q_a_proj.",
            "kv_a_proj_with_mqa.",
        )
    )
    if replicated:
        return ShardRule(stage, None, "tp", expert)
    if leaf in _COLUMN:
        dim = 0
    elif leaf in _ROW:
        dim = 1
    else:
        raise PlanError(f"no trainer sharding rule for tensor {name}")
    return ShardRule(stage, dim, "etp" if expert is not None else "tp", expert)


@lru_cache(maxsize=256)
def _stage_of_layer(num_layers: int, pp: int, layer: int) -> int:
    from kvmove.layout import split_layers

    for stage, layers in enumerate(split_layers(num_layers, pp, extra_first=True)):
        if layer in layers:
            return stage
    raise PlanError(f"layer {layer} is outside the model's {num_layers} layers")


class Ownership:
    """Answers which trainer ranks hold which box of each tensor, before and after a gather."""

    def __init__(self, cfg: ModelConfig, layout: TrainerLayout) -> None:
        self.cfg, self.layout = cfg, layout
        self.coords = [layout.coord(r) for r in range(layout.world)]
        self._experts_per_rank = cfg.num_experts // layout.ep if cfg.is_moe else 0
        self._groups: dict[tuple[str, int, int | None], tuple[int, ...]] = {}

    def _owners(self, rule: ShardRule) -> tuple[int, ...]:
        """Ranks holding some shard of a tensor with this rule (a stage, or an EP rank's ranks in it)."""
        ep = None if rule.expert is None else rule.expert // self._experts_per_rank
        key = ("stage", rule.stage, ep)
        if key not in self._groups:
            ranks = self.layout.stage_ranks(rule.stage)
            self._groups[key] = tuple(r for r in ranks if ep is None or self.coords[r].ep == ep)
        return self._groups[key]

    def slices(self, t: TensorMeta) -> tuple[Holding, ...]:
        """Raw shards: every (rank, box) as the trainer holds them (the all-gathered ownership metadata)."""
        rule = shard_rule(self.cfg, self.layout, t.name)
        out = []
        for rank in self._owners(rule):
            box = Box.full(t.shape)
            if rule.dim is not None:
                c = self.coords[rank]
                size, index = (self.layout.etp, c.etp) if rule.group == "etp" else (self.layout.tp, c.tp)
                n = t.shape[rule.dim] // size
                start, stop = list(box.start), list(box.stop)
                start[rule.dim], stop[rule.dim] = index * n, (index + 1) * n
                box = Box(tuple(start), tuple(stop))
            out.append(Holding(rank, box))
        return tuple(out)

    def holders(self, name: str, scope: Gather | str) -> tuple[int, ...]:
        """Ranks holding the *full* tensor once a gather of ``scope`` ran."""
        scope = Gather(scope)
        if scope is Gather.STAGE:
            return self._owners(shard_rule(self.cfg, self.layout, name))
        return tuple(range(self.layout.world)) if scope is Gather.GLOBAL else (0,)

    def gather_group(self, t: TensorMeta, rank: int) -> tuple[int, ...]:
        """The ranks whose shards ``rank`` all-gathers to materialize ``t`` inside its stage (its tp or etp group)."""
        rule = shard_rule(self.cfg, self.layout, t.name)
        if rule.dim is None:
            return (rank,)
        c = self.coords[rank]
        owners = self._owners(rule)
        if rule.group == "etp":
            return tuple(r for r in owners if self.coords[r].edp == c.edp)
        return tuple(r for r in owners if self.coords[r].dp == c.dp)
