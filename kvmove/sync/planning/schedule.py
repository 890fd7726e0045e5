"""Sync schedules (pure planning): which tensors form each sync group, and who pulls what from whom.

A *group* is the unit of gather, transfer and release; a strategy's ``Grouping`` makes one group per tensor (the
simple iterator, v1), one per pipeline stage (v2), or one per ``group_size`` consecutive decoder blocks plus a
group for the embedding and one for the final norm and head (v3). A :class:`PullPlan` lists, for one engine
rank, the pulls of each group: a trainer rank and the indices of the entries it packs (kvmove.sync.planning.entries:
the regions of a BF16 engine one by one; an FP8 engine's quantized covers and pieces too).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta, layer_of
from kvmove.sync.config import SyncOptions
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.entries import PLAIN, EntryPlan
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
    """One pull: engine rank ``engine`` gets entries ``entries`` (indices into its ``EntryPlan``) of ``group`` from
    ``trainer``; ``nbytes`` cross the link.

    A packed pull is packed by the trainer into a slot, read into a receive slot and landed; a direct pull
    (``direct`` non-empty) is read from the trainer's arena into the parameters: (parameter, byte spans).
    """

    group: int
    trainer: int
    entries: tuple[int, ...]
    nbytes: int
    direct: tuple[tuple[str, np.ndarray], ...] = ()


class PullPlan(NamedTuple):
    engine: int
    pulls: tuple[Pull, ...]
    plan: EntryPlan | None = None
    """The entries ``pulls`` index (shared by the ranks of every replica holding the same plan)."""

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
    """Per engine rank: its entries bucketed by (group, source trainer, direct or packed), in group order.

    With ``direct``, every plain entry it can serve from the source's arena goes into that bucket's direct pull,
    and a plain entry read in pieces (``source_map.pieces``) into the direct pull of each piece's trainer rank.
    Quantized covers and their pieces are always packed.
    """
    group_of = {t.name: g for g, ts in groups.items() for t in ts}
    out = []
    known: dict[tuple[int, int, int], np.ndarray | None] = {}  # replicas share plans: (local rank, entry, source)
    for e in range(layout.world):
        local = layout.coord(e).local
        plan, entry_plan = plans[local], source_map.entries[local]
        dtypes = {p.name: p.dtype for p in plan.params}
        buckets: dict[tuple[int, int, bool], list[_Item]] = defaultdict(list)
        for i, (entry, src) in enumerate(zip(entry_plan.entries, source_map.sources[e], strict=True)):
            group = group_of[entry.tensor]
            pieces = source_map.pieces.get((e, i))
            staged = bool(entry.regions) and plan.regions[entry.regions[0]].param in plan.staged
            if pieces and direct is not None:
                param = plan.regions[entry.regions[0]].param
                for t, piece in pieces:
                    runs = direct.spans(piece, t, dtypes[param])
                    assert runs is not None, "routing cut the region into pieces that read directly"
                    buckets[(group, t, True)].append(_Item(i, param, piece.nbytes, runs))
                continue
            runs, param = None, ""
            if direct is not None and entry.transform == PLAIN and not staged:
                region = plan.regions[entry.regions[0]]
                key, param = (local, i, src), region.param
                if key not in known:
                    known[key] = direct.spans(region, src, dtypes[region.param])
                runs = known[key]
            buckets[(group, src, runs is not None)].append(_Item(i, param, entry.nbytes, runs))
        pulls = tuple(_pull(g, t, items) for (g, t, _), items in sorted(buckets.items()))
        out.append(PullPlan(e, pulls, entry_plan))
    return tuple(out)


class _Item(NamedTuple):
    """An entry (or a piece of one) in a pull: its parameter and spans when read directly."""

    entry: int
    param: str
    nbytes: int
    runs: np.ndarray | None


def _pull(group: int, trainer: int, items: list[_Item]) -> Pull:
    by_param: dict[str, list[np.ndarray]] = defaultdict(list)
    for item in items:
        if item.runs is not None:
            by_param[item.param].append(item.runs)
    runs = tuple((name, coalesce(np.concatenate(rs))) for name, rs in by_param.items())
    entries = tuple(dict.fromkeys(item.entry for item in items))
    return Pull(group, trainer, entries, sum(item.nbytes for item in items), runs)


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


def gathered_names(pull_plans_: Sequence[PullPlan]) -> set[str]:
    """HF tensors some packed pull reads from a materialized tensor: the only ones a trainer must gather in the sync
    (entries served from raw shards read them in place)."""
    out: set[str] = set()
    for pp in pull_plans_:
        assert pp.plan is not None
        for _, p in packed(pp):
            out.update(e.tensor for i in p.entries if not (e := pp.plan.entries[i]).shard)
    return out
