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
import torch

from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta, layer_of
from kvmove.sync.config import SyncOptions
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.entries import PLAIN, Entry, EntryPlan, mappable
from kvmove.sync.planning.ownership import shard_rule
from kvmove.sync.planning.plan import Box, ShardingPlan
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


PACKED, DIRECT, MAPPED = 0, 1, 2
"""Kinds of pull of one (group, trainer rank) bucket, in pull order."""


class MappedSource(NamedTuple):
    """Where a mapped entry's cover lies in the serving rank's arena: the raw shard holding it (its byte offset in
    the arena, its box of the HF tensor, its dtype)."""

    entry: int
    offset: int
    shard: Box
    dtype: torch.dtype


class Pull(NamedTuple):
    """One pull: engine rank ``engine`` gets entries ``entries`` (indices into its ``EntryPlan``) of ``group`` from
    ``trainer``; ``nbytes`` cross the link.

    A packed pull is packed by the trainer into a slot, read into a receive slot and landed; a direct pull
    (``direct`` non-empty) is read from the trainer's arena into the parameters: (parameter, byte spans); a mapped
    pull (``mapped`` non-empty) is quantized by the engine itself from its mapped view of the trainer's arena into
    the parameters (no request, no read, no slot); ``nbytes`` counts the FP8 bytes it lands, as the packed pull
    it replaces would have moved.
    """

    group: int
    trainer: int
    entries: tuple[int, ...]
    nbytes: int
    direct: tuple[tuple[str, np.ndarray], ...] = ()
    mapped: tuple[MappedSource, ...] = ()

    @property
    def packed(self) -> bool:
        """Packed by the trainer into a serve slot (neither direct nor mapped)."""
        return not self.direct and not self.mapped


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
    maps: Callable[[int, int], bool] | None = None,
) -> tuple[PullPlan, ...]:
    """Per engine rank: its entries bucketed by (group, source trainer, packed, direct or mapped), in group order.

    With ``direct``, every plain entry it can serve from the source's arena goes into that bucket's direct pull,
    and a plain entry read in pieces (``source_map.pieces``) into the direct pull of each piece's trainer rank.
    With ``direct`` and ``maps`` (``maps(engine, trainer)``: the engine rank maps that trainer rank's arena on its
    own device), every quantized cover lying in the serving rank's raw shard (``entries.mappable``) goes into the
    bucket's mapped pull. Other quantized covers and their pieces are packed.
    """
    group_of = {t.name: g for g, ts in groups.items() for t in ts}
    out = []
    known: dict[tuple[int, int, int], np.ndarray | None] = {}  # replicas share plans: (local rank, entry, source)
    for e in range(layout.world):
        local = layout.coord(e).local
        plan, entry_plan = plans[local], source_map.entries[local]
        dtypes = {p.name: p.dtype for p in plan.params}
        buckets: dict[tuple[int, int, int], list[_Item]] = defaultdict(list)
        for i, (entry, src) in enumerate(zip(entry_plan.entries, source_map.sources[e], strict=True)):
            group = group_of[entry.tensor]
            pieces = source_map.pieces.get((e, i))
            staged = bool(entry.regions) and plan.regions[entry.regions[0]].param in plan.staged
            if pieces and direct is not None:
                param = plan.regions[entry.regions[0]].param
                for t, piece in pieces:
                    runs = direct.spans(piece, t, dtypes[param])
                    assert runs is not None, "routing cut the region into pieces that read directly"
                    buckets[(group, t, DIRECT)].append(_Item(i, param, piece.nbytes, runs))
                continue
            if direct is not None and maps is not None and mappable(entry) and maps(e, src):
                buckets[(group, src, MAPPED)].append(_Item(i, "", entry.nbytes, None, _mapped(direct, i, entry, src)))
                continue
            runs, param = None, ""
            if direct is not None and entry.transform == PLAIN and not staged:
                region = plan.regions[entry.regions[0]]
                key, param = (local, i, src), region.param
                if key not in known:
                    known[key] = direct.spans(region, src, dtypes[region.param])
                runs = known[key]
            buckets[(group, src, PACKED if runs is None else DIRECT)].append(_Item(i, param, entry.nbytes, runs))
        pulls = tuple(_pull(g, t, items) for (g, t, _), items in sorted(buckets.items()))
        out.append(PullPlan(e, pulls, entry_plan))
    return tuple(out)


class _Item(NamedTuple):
    """An entry (or a piece of one) in a pull: its parameter and spans when read directly, its raw shard when
    mapped."""

    entry: int
    param: str
    nbytes: int
    runs: np.ndarray | None
    mapped: MappedSource | None = None


def _mapped(direct: DirectPlanner, i: int, entry: Entry, trainer: int) -> MappedSource:
    arena, meta = direct.arenas[trainer], direct.metas[entry.tensor]
    return MappedSource(i, arena.offsets[entry.tensor], arena.boxes[entry.tensor], meta.dtype)


def _pull(group: int, trainer: int, items: list[_Item]) -> Pull:
    by_param: dict[str, list[np.ndarray]] = defaultdict(list)
    for item in items:
        if item.runs is not None:
            by_param[item.param].append(item.runs)
    runs = tuple((name, coalesce(np.concatenate(rs))) for name, rs in by_param.items())
    entries = tuple(dict.fromkeys(item.entry for item in items))
    mapped = tuple(item.mapped for item in items if item.mapped is not None)
    return Pull(group, trainer, entries, sum(item.nbytes for item in items), runs, mapped)


def packed(pull_plan: PullPlan) -> list[tuple[int, Pull]]:
    """(pull id, pull) of the pulls the trainer packs (neither direct nor mapped)."""
    return [(i, p) for i, p in enumerate(pull_plan.pulls) if p.packed]


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
