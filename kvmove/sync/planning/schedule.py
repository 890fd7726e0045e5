"""Sync schedules (pure planning): which tensors form each sync group, and who pulls what from whom.

A *group* is the unit of gather, transfer and release; a strategy's ``Grouping`` makes one group per tensor (the
simple iterator, v1), one per pipeline stage (v2), or one per ``group_size`` consecutive decoder blocks plus a
group for the embedding and one for the final norm and head (v3). A :class:`PullPlan` lists, for one engine
rank, the pulls of each group: a trainer rank and the indices of the plan regions it packs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import TensorMeta, hf_tensors, layer_of
from kvmove.sync.config import SyncOptions
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.ownership import shard_rule
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.planning.routing import SourceMap
from kvmove.sync.strategies import Grouping, Strategy
from kvmove.transport.base import coalesce


class _Slot(NamedTuple):
    """One tensor as a grouping sees it."""

    position: int
    name: str
    before_layers: bool
    stage: Callable[[str], int]
    options: SyncOptions
    num_layers: int


def _by_blocks(t: _Slot) -> int:
    layer = layer_of(t.name)
    if layer is None:
        return -1 if t.before_layers else t.num_layers
    return layer // t.options.group_size


GROUP_KEYS: dict[Grouping, Callable[[_Slot], int]] = {
    Grouping.TENSOR: lambda t: t.position,
    Grouping.STAGE: lambda t: t.stage(t.name),
    Grouping.BLOCKS: _by_blocks,
}
"""Grouping -> key of one tensor (groups are processed in increasing key order)."""


class Pull(NamedTuple):
    """One pull: engine rank ``engine`` gets regions ``regions`` (plan indices) of ``group`` from ``trainer``.

    A packed pull is packed by the trainer into a slot, read into a receive slot and loaded; a direct pull
    (``direct`` non-empty) is read from the trainer's arena into the parameters: (parameter, byte spans).
    """

    group: int
    trainer: int
    regions: tuple[int, ...]
    nbytes: int
    direct: tuple[tuple[str, np.ndarray], ...] = ()


class PullPlan(NamedTuple):
    engine: int
    pulls: tuple[Pull, ...]

    def groups(self) -> list[int]:
        return sorted({p.group for p in self.pulls})


def tensor_groups(
    cfg: ModelConfig,
    trainer: TrainerLayout,
    strategy: Strategy,
    options: SyncOptions,
    tensors: Sequence[TensorMeta] | None = None,
    stage_of: Callable[[str], int] | None = None,
) -> dict[int, list[TensorMeta]]:
    """Group -> tensors in checkpoint order, by the strategy's grouping.

    ``tensors`` (default: the HF checkpoint's) are the source's tensors in its order; ``stage_of`` names each one's
    pipeline stage (default: Megatron's rule for HF names). Tensors outside decoder layers form the first group
    when they come before the first layer (embeddings), else the last (final norm, head).
    """
    tensors = hf_tensors(cfg) if tensors is None else tensors
    stage = stage_of or (lambda name: shard_rule(cfg, trainer, name).stage)
    first_layer = next((i for i, t in enumerate(tensors) if layer_of(t.name) is not None), len(tensors))
    key = GROUP_KEYS[strategy.grouping]
    groups: dict[int, list[TensorMeta]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[key(_Slot(i, t.name, i < first_layer, stage, options, cfg.num_hidden_layers))].append(t)
    return dict(sorted(groups.items()))


def pull_plans(
    plans: Sequence[ShardingPlan],
    layout: EngineLayout,
    source_map: SourceMap,
    groups: dict[int, list[TensorMeta]],
    direct: DirectPlanner | None = None,
) -> tuple[PullPlan, ...]:
    """Per engine rank: its regions bucketed by (group, source trainer, direct or packed), in group order.

    With ``direct``, every region it can serve from the source's arena goes into that bucket's direct pull, and a
    region read in pieces (``source_map.pieces``) into the direct pull of each piece's trainer rank.
    """
    group_of = {t.name: g for g, ts in groups.items() for t in ts}
    out = []
    known: dict[tuple[int, int, int], np.ndarray | None] = {}  # replicas share plans: (local rank, region, source)
    for e in range(layout.world):
        local = layout.coord(e).local
        plan = plans[local]
        dtypes = {p.name: p.dtype for p in plan.params}
        buckets: dict[tuple[int, int, bool], list[_Entry]] = defaultdict(list)
        for i, (region, src) in enumerate(zip(plan.regions, source_map.sources[e], strict=True)):
            group = group_of[region.hf_name]
            pieces = source_map.pieces.get((e, i))
            if pieces and direct is not None:
                for t, piece in pieces:
                    runs = direct.spans(piece, t, dtypes[region.param])
                    assert runs is not None, "routing cut the region into pieces that read directly"
                    buckets[(group, t, True)].append(_Entry(i, piece.nbytes, runs))
                continue
            runs = None
            if direct is not None:
                key = (local, i, src)
                if key not in known:
                    known[key] = direct.spans(region, src, dtypes[region.param])
                runs = known[key]
            buckets[(group, src, runs is not None)].append(_Entry(i, region.nbytes, runs))
        out.append(PullPlan(e, tuple(_pull(g, t, entries, plan) for (g, t, _), entries in sorted(buckets.items()))))
    return tuple(out)


class _Entry(NamedTuple):
    region: int
    nbytes: int
    runs: np.ndarray | None


def _pull(group: int, trainer: int, entries: list[_Entry], plan: ShardingPlan) -> Pull:
    by_param: dict[str, list[np.ndarray]] = defaultdict(list)
    for entry in entries:
        if entry.runs is not None:
            by_param[plan.regions[entry.region].param].append(entry.runs)
    runs = tuple((name, coalesce(np.concatenate(rs))) for name, rs in by_param.items())
    regions = tuple(dict.fromkeys(entry.region for entry in entries))
    return Pull(group, trainer, regions, sum(entry.nbytes for entry in entries), runs)


def packed(pull_plan: PullPlan) -> list[tuple[int, Pull]]:
    """(pull id, pull) of the pulls the trainer packs (not direct)."""
    return [(i, p) for i, p in enumerate(pull_plan.pulls) if not p.direct]


def consumers(pull_plans_: Sequence[PullPlan], trainer_rank: int) -> dict[int, set[int]]:
    """Group -> engine ranks that pull something packed of it from ``trainer_rank`` (the release barrier)."""
    out: dict[int, set[int]] = defaultdict(set)
    for pp in pull_plans_:
        for _, p in packed(pp):
            if p.trainer == trainer_rank:
                out[p.group].add(pp.engine)
    return dict(out)


def packed_names(plans: Sequence[ShardingPlan], layout: EngineLayout, pull_plans_: Sequence[PullPlan]) -> set[str]:
    """HF tensors some packed pull reads: the only ones a trainer must materialize (gather) in the sync."""
    out: set[str] = set()
    for pp in pull_plans_:
        plan = plans[layout.coord(pp.engine).local]
        for _, p in packed(pp):
            out.update(plan.regions[r].hf_name for r in p.regions)
    return out
