"""Trainer ownership: which trainer ranks hold which slice of every HF tensor (metadata only).

``shard_rule`` states Megatron's split of each tensor (its role from kvmove.models.roles' family tables);
``Ownership.slices`` gives the raw shards as the trainer
holds them (what it would all-gather), and ``Ownership.holders`` what each rank holds once a strategy's
gather scope has run (kvmove.sync.strategies): ``stage`` gathers TP (and ETP for experts) inside a pipeline
stage, ``global`` gathers everything everywhere, ``root`` gathers onto rank 0 only.

:class:`DeclaredOwnership` answers the same questions from the shards the trainer ranks *report* (init step 1),
for sources whose placement follows no Megatron rule (FSDP2's dim-0 shards over the data-parallel ranks, or
Megatron-named tensors): a tensor's stage gather runs among the ranks that hold a piece of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from typing import NamedTuple, Protocol

from kvmove.errors import ModelError, PlanError
from kvmove.models.config import ModelConfig
from kvmove.models.experts import fused_experts
from kvmove.models.layout import TrainerLayout
from kvmove.models.megatron import megatron_split
from kvmove.models.roles import Role, check_classified, role_of
from kvmove.models.tensors import TensorMeta, expert_of, layer_of
from kvmove.sync.planning.plan import Box
from kvmove.sync.strategies import Gather


class ShardRule(NamedTuple):
    """How the trainer splits one tensor: along ``dim`` over the ``group`` (None: replicated)."""

    stage: int
    dim: int | None
    group: str  # "tp" (dense, attention, shared experts) or "etp" (routed experts)
    expert: int | None
    fused: bool = False
    """Every expert of a layer in this one tensor (its dim 0): whole experts over EP, ``dim`` over ETP."""


class Holding(NamedTuple):
    rank: int
    box: Box


def shard_rule(cfg: ModelConfig, layout: TrainerLayout, name: str) -> ShardRule:
    """Megatron's sharding of HF tensor ``name`` under ``layout``: its role from the family table
    (kvmove.models.roles), its stage from the layer it is in; PlanError naming a tensor no rule classifies."""
    role = role_of(cfg, name)
    layer = layer_of(name)
    if layer is None:
        stage = 0 if name == "model.embed_tokens.weight" else layout.pp - 1
    else:
        stage = _stage_of_layer(cfg.num_hidden_layers, layout.pp, layer)
    if role.fused:
        _check_gate_up(cfg, layout, name, role)
        return ShardRule(stage, role.dim, "etp", None, fused=True)
    expert = expert_of(name)
    if role.dim is None:
        return ShardRule(stage, None, "tp", expert)
    return ShardRule(stage, role.dim, "etp" if expert is not None else "tp", expert)


def _check_gate_up(cfg: ModelConfig, layout: TrainerLayout, name: str, role: Role) -> None:
    """An ETP split of a fused gate/up tensor is one block per rank only where gate and up interleave
    (kvmove.models.experts); with halves, each rank would hold two blocks, which a shard box cannot state."""
    if layout.etp == 1 or role not in (Role.EXPERTS_COLUMN, Role.EXPERTS_COLUMN_BIAS):
        return
    if not fused_experts(cfg).interleaved:
        raise PlanError(
            f"trainer etp={layout.etp}: {cfg.architecture} keeps gate and up in two halves of {name}, so each ETP "
            "rank would hold two blocks of it and kvmove's trainer shards are one block per rank (use etp=1)"
        )


def megatron_rule(cfg: ModelConfig, layout: TrainerLayout, name: str) -> ShardRule:
    """megatron-core's sharding of its own tensor ``name`` (``kvmove.models.megatron``) under ``layout``."""
    layer = layer_of(name)
    if layer is None:
        stage = 0 if name == "embedding.word_embeddings.weight" else layout.pp - 1
    else:
        stage = _stage_of_layer(cfg.num_hidden_layers, layout.pp, layer)
    try:
        dim, group = megatron_split(cfg, name)
    except ModelError as exc:
        raise PlanError(str(exc)) from None
    return ShardRule(stage, dim, group, expert_of(name))


Rule = Callable[[ModelConfig, TrainerLayout, str], ShardRule]


@lru_cache(maxsize=256)
def _stage_of_layer(num_layers: int, pp: int, layer: int) -> int:
    from kvmove.models.layout import split_layers

    for stage, layers in enumerate(split_layers(num_layers, pp, extra_first=True)):
        if layer in layers:
            return stage
    raise PlanError(f"layer {layer} is outside the model's {num_layers} layers")


class Owners(Protocol):
    """What planning reads of a trainer's ownership (rule-based :class:`Ownership` or :class:`DeclaredOwnership`)."""

    @property
    def world(self) -> int: ...

    def slices(self, t: TensorMeta) -> tuple[Holding, ...]: ...

    def holders(self, name: str, scope: Gather) -> tuple[int, ...]: ...

    def stage_of(self, name: str) -> int: ...


class Ownership:
    """Answers which trainer ranks hold which box of each tensor, before and after a gather."""

    def __init__(self, cfg: ModelConfig, layout: TrainerLayout, rule: Rule | None = None) -> None:
        """``rule``: Megatron's split of each tensor by name (default: :func:`shard_rule` of HF names)."""
        self.cfg, self.layout = cfg, layout
        self.world = layout.world
        self.rule: Rule = rule or shard_rule
        self._rules: dict[str, ShardRule] = {}
        self._slices: dict[str, tuple[Holding, ...]] = {}
        self._alike: dict[tuple[object, ...], tuple[Holding, ...]] = {}
        if rule is None:
            check_classified(cfg)  # NOTE: up front, naming the tensor, rather than in whichever planner asks first
            self._check_splits()
        self.coords = [layout.coord(r) for r in range(layout.world)]
        self._experts_per_rank = cfg.num_experts // layout.ep if cfg.is_moe else 0
        self._groups: dict[tuple[str, int, int | None], tuple[int, ...]] = {}
        self._everyone = tuple(range(layout.world))

    def _check_splits(self) -> None:
        """Every split dim of every tensor (one layer of each kind stands for the rest) divides evenly over its
        group; PlanError naming the first tensor whose does not."""
        from kvmove.models.table import table_of

        table = table_of(self.cfg)
        for t in [*table.head, *(t for _, ts in table.templates.values() for t in ts), *table.tail]:
            rule = self.rule(self.cfg, self.layout, t.name)
            cuts = [(0, "ep", self.layout.ep)] if rule.fused else []
            if rule.dim is not None:
                cuts.append((rule.dim, rule.group, self.layout.etp if rule.group == "etp" else self.layout.tp))
            for dim, group, size in cuts:
                if t.shape[dim] % size:
                    cut = f"dim {dim} ({t.shape[dim]}) of tensor {t.name} {t.shape}"
                    raise PlanError(f"trainer {group}={size} does not divide {cut}")

    def _owners(self, rule: ShardRule) -> tuple[int, ...]:
        """Ranks holding some shard of a tensor with this rule (a stage, or an EP rank's ranks in it)."""
        ep = None if rule.expert is None else rule.expert // self._experts_per_rank
        key = ("stage", rule.stage, ep)
        if key not in self._groups:
            ranks = self.layout.stage_ranks(rule.stage)
            self._groups[key] = tuple(r for r in ranks if ep is None or self.coords[r].ep == ep)
        return self._groups[key]

    def rule_of(self, name: str) -> ShardRule:
        """The split of tensor ``name`` (memoized: planning asks for every region of every engine rank)."""
        rule = self._rules.get(name)
        if rule is None:
            rule = self._rules[name] = self.rule(self.cfg, self.layout, name)
        return rule

    def slices(self, t: TensorMeta) -> tuple[Holding, ...]:
        """Raw shards: every (rank, box) as the trainer holds them (the all-gathered ownership metadata)."""
        held = self._slices.get(t.name)
        if held is None:
            rule = self.rule_of(t.name)
            owners = self._owners(rule)
            # NOTE: the boxes depend on the shape, the split and the owners only: tensors alike share them
            alike = (t.shape, rule.fused, rule.dim, rule.group, owners)
            held = self._alike.get(alike)
            if held is None:
                held = self._alike[alike] = tuple(Holding(rank, self._box(t, rule, rank)) for rank in owners)
            self._slices[t.name] = held
        return held

    def _box(self, t: TensorMeta, rule: ShardRule, rank: int) -> Box:
        c = self.coords[rank]
        start, stop = [0] * len(t.shape), list(t.shape)
        cuts = [(0, self.layout.ep, c.ep)] if rule.fused else []  # fused experts: whole experts over EP
        if rule.dim is not None:
            cuts.append((rule.dim, *((self.layout.etp, c.etp) if rule.group == "etp" else (self.layout.tp, c.tp))))
        for dim, size, index in cuts:
            n = t.shape[dim] // size
            start[dim], stop[dim] = index * n, (index + 1) * n
        return Box(tuple(start), tuple(stop))

    def holders(self, name: str, scope: Gather | str) -> tuple[int, ...]:
        """Ranks holding the *full* tensor once a gather of ``scope`` ran."""
        scope = scope if isinstance(scope, Gather) else Gather(scope)
        if scope is Gather.STAGE:
            return self._owners(self.rule_of(name))
        return self._everyone if scope is Gather.GLOBAL else (0,)

    def stage_of(self, name: str) -> int:
        return self.rule_of(name).stage

    def gather_group(self, t: TensorMeta, rank: int) -> tuple[int, ...]:
        """The ranks whose shards ``rank`` all-gathers to materialize ``t`` inside its stage (its tp or etp group)."""
        rule = self.rule_of(t.name)
        c = self.coords[rank]
        owners = self._owners(rule)
        if rule.fused:  # the EP ranks (and, where it is split over ETP, the ETP ranks) of this rank's edp replica
            etp = rule.dim is not None and self.layout.etp > 1
            return tuple(r for r in owners if self.coords[r].edp == c.edp and (etp or self.coords[r].etp == c.etp))
        if rule.dim is None:
            return (rank,)
        if rule.group == "etp":
            return tuple(r for r in owners if self.coords[r].edp == c.edp)
        return tuple(r for r in owners if self.coords[r].dp == c.dp)


class DeclaredOwnership:
    """Ownership as the trainer ranks declare it: ``shards[rank]`` maps each tensor name to the box it holds.

    ``holders(name, STAGE)`` are the ranks holding a piece of ``name`` (its gather runs among them and leaves
    each with the full tensor); a tensor's stage is the pipeline stage of its first holder in ``layout``.
    """

    def __init__(self, shards: Mapping[int, Mapping[str, Box]], layout: TrainerLayout) -> None:
        self.layout, self.world = layout, layout.world
        self._slices: dict[str, list[Holding]] = {}
        for rank in sorted(shards):
            for name, box in shards[rank].items():
                self._slices.setdefault(name, []).append(Holding(rank, box))
        self._owners = {name: tuple(h.rank for h in hs) for name, hs in self._slices.items()}

    def names(self) -> Iterable[str]:
        return self._slices.keys()

    def slices(self, t: TensorMeta) -> tuple[Holding, ...]:
        try:
            return tuple(self._slices[t.name])
        except KeyError:
            raise PlanError(f"no trainer rank holds tensor {t.name}") from None

    def holders(self, name: str, scope: Gather) -> tuple[int, ...]:
        if scope is Gather.STAGE:
            return self._owners[name]
        return tuple(range(self.world)) if scope is Gather.GLOBAL else (0,)

    def stage_of(self, name: str) -> int:
        return self.layout.coord(self._owners[name][0]).pp

    def check_tiles(self, tensors: Iterable[TensorMeta]) -> None:
        """Every tensor is covered exactly by the distinct boxes held of it (replicas of a box count once)."""
        for t in tensors:
            boxes = sorted({h.box for h in self._slices.get(t.name, ())})
            if not boxes:
                raise PlanError(f"no trainer rank holds tensor {t.name}")
            full = Box.full(t.shape)
            if any(not full.contains(b) for b in boxes) or sum(b.numel for b in boxes) != t.numel:
                raise PlanError(f"the shards trainer ranks hold of {t.name} {t.shape} do not tile it: {boxes}")
            for i, a in enumerate(boxes):
                if any(_overlap(a, b) for b in boxes[i + 1 :] if a.numel and b.numel):
                    raise PlanError(f"trainer shards {a} and the others of {t.name} overlap")


def _overlap(a: Box, b: Box) -> bool:
    return all(max(s1, s2) < min(e1, e2) for s1, e1, s2, e2 in zip(a.start, a.stop, b.start, b.stop, strict=True))
