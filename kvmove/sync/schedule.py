"""Sync schedules (pure planning): which tensors form each sync group, and who pulls what from whom.

A *group* is the unit of gather, transfer and release. v1 makes one group per tensor (the simple iterator),
v2 one group per pipeline stage, v3 one group per ``group_size`` consecutive decoder blocks (plus a group for
the embedding and one for the final norm and head). A :class:`PullPlan` lists, for one engine rank, the pulls
of each group: a trainer rank and the indices of the plan regions it packs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import TensorMeta, hf_tensors, layer_of
from kvmove.sync.ownership import shard_rule
from kvmove.sync.plan import ShardingPlan
from kvmove.sync.routing import SourceMap
from kvmove.sync.strategies import Strategy


@dataclass(frozen=True)
class SyncOptions:
    """Knobs of the pipelined strategy (v3)."""

    group_size: int = 1
    """Decoder blocks per group."""
    lookahead: int = 1
    """Groups a trainer rank may gather ahead of the oldest group not yet released by every consumer."""


def group_key(cfg: ModelConfig, trainer: TrainerLayout, strategy: Strategy, options: SyncOptions, name: str) -> int:
    """The group of HF tensor ``name`` under ``strategy`` (groups are processed in increasing order)."""
    if strategy.name == "v2":
        return shard_rule(cfg, trainer, name).stage
    layer = layer_of(name)
    if layer is None:
        return -1 if name == "model.embed_tokens.weight" else cfg.num_hidden_layers
    return layer // options.group_size


class Pull(NamedTuple):
    """One pull: engine rank ``engine`` gets regions ``regions`` (plan indices) of ``group`` from ``trainer``."""

    group: int
    trainer: int
    regions: tuple[int, ...]
    nbytes: int


class PullPlan(NamedTuple):
    engine: int
    pulls: tuple[Pull, ...]

    def groups(self) -> list[int]:
        return sorted({p.group for p in self.pulls})


def tensor_groups(
    cfg: ModelConfig, trainer: TrainerLayout, strategy: Strategy, options: SyncOptions
) -> dict[int, list[TensorMeta]]:
    """Group -> tensors in checkpoint order. v1 numbers every tensor as its own group."""
    groups: dict[int, list[TensorMeta]] = defaultdict(list)
    for i, t in enumerate(hf_tensors(cfg)):
        key = i if strategy.name == "v1" else group_key(cfg, trainer, strategy, options, t.name)
        groups[key].append(t)
    return dict(sorted(groups.items()))


def pull_plans(
    plans: Sequence[ShardingPlan],
    layout: EngineLayout,
    source_map: SourceMap,
    groups: dict[int, list[TensorMeta]],
) -> tuple[PullPlan, ...]:
    """Per engine rank: its regions bucketed by (group, source trainer), in group order."""
    group_of = {t.name: g for g, ts in groups.items() for t in ts}
    out = []
    for e in range(layout.world):
        plan = plans[layout.coord(e).local]
        buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (region, src) in enumerate(zip(plan.regions, source_map.sources[e], strict=True)):
            buckets[(group_of[region.hf_name], src)].append(i)
        pulls = [
            Pull(g, t, tuple(idx), sum(plan.regions[i].nbytes for i in idx)) for (g, t), idx in sorted(buckets.items())
        ]
        out.append(PullPlan(e, tuple(pulls)))
    return tuple(out)


def consumers(pull_plans_: Sequence[PullPlan], trainer_rank: int) -> dict[int, set[int]]:
    """Group -> engine ranks that pull something of it from ``trainer_rank`` (the release barrier)."""
    out: dict[int, set[int]] = defaultdict(set)
    for pp in pull_plans_:
        for p in pp.pulls:
            if p.trainer == trainer_rank:
                out[p.group].add(pp.engine)
    return dict(out)
