"""How a strategy groups the checkpoint's tensors: one group per tensor, per pipeline stage or per decoder block.

Experts of one projection of one layer form one item (they move together); per-tensor grouping keeps one
representative per kind of tensor with its multiplicity (every layer of a kind, every expert, costs the same).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvmove.bench.sim.setup import SimSetup
from kvmove.bench.sim.shards import wire_bytes
from kvmove.bench.sim.strategies import SimStrategy
from kvmove.models.config import ModelConfig
from kvmove.models.table import hf_tensors, layer_kind, layer_tensors


class Item(NamedTuple):
    """One HF tensor, or ``experts`` expert tensors of one projection of one layer (from ``expert0`` on)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    expert0: int | None = None
    experts: int = 0

    @property
    def tensors(self) -> int:
        return self.experts or 1


class Unit(NamedTuple):
    """One group: its items, how many times it occurs, and the decoder layers whose reload completes in it
    (``reload`` lists the items of those layers, so the reload's bytes can be counted)."""

    items: list[Item]
    times: float
    layers: int
    reload: list[Item]


def units(s: SimSetup, strategy: SimStrategy) -> list[Unit]:
    """The groups of ``strategy`` on ``s``, in sync order (a bucketing broadcast sender's: its buckets)."""
    cfg = s.model
    if strategy.broadcast and s.bucket_bytes:
        return buckets(s)
    if strategy.grouping == "tensor":
        return _representatives(cfg, s if strategy.broadcast and s.funnel else None)
    pre, post = outer_items(cfg)
    layers = list(range(cfg.num_hidden_layers))
    if strategy.grouping == "layer":
        size = s.group_size
        blocks = [layers[i : i + size] for i in range(0, len(layers), size)]
        body = [_unit(layer_items(cfg, blk), len(blk)) for blk in blocks]
        return [Unit(pre, 1.0, 0, []), *body, Unit(post, 1.0, 0, [])]
    if s.trainer.kind != "megatron":
        return [_unit(pre + layer_items(cfg, layers) + post, len(layers))]
    out = [_unit(layer_items(cfg, list(r)), len(r)) for r in s.trainer.layout.stage_layers(cfg)]
    out[0] = out[0]._replace(items=pre + out[0].items)
    out[-1] = out[-1]._replace(items=out[-1].items + post)
    return out


def _unit(items: list[Item], layers: int) -> Unit:
    return Unit(items, 1.0, layers, [i for i in items if i.layer is not None])


def outer_items(cfg: ModelConfig) -> tuple[list[Item], list[Item]]:
    """(embedding, [final norm, head]) as items."""
    outer = [Item(t.name, t.shape, None) for t in hf_tensors(cfg, layers=())]
    return [i for i in outer if "embed" in i.name], [i for i in outer if "embed" not in i.name]


_KINDS: dict[tuple[ModelConfig, str], tuple[list[Item], list[Item]]] = {}


def kind_items(cfg: ModelConfig, layer: int) -> tuple[list[Item], list[Item]]:
    """(non-expert items, one item per expert projection) of ``layer``; tensor tables are built once per kind."""
    key = (cfg, layer_kind(cfg, layer))
    if key not in _KINDS:
        ts = layer_tensors(cfg, layer)
        plain = [Item(t.name, t.shape, layer) for t in ts if t.expert is None]
        expert = [Item(t.name, t.shape, layer, 0, cfg.num_experts) for t in ts if t.expert == 0]
        _KINDS[key] = (plain, expert)
    plain, expert = _KINDS[key]
    old, new = f"model.layers.{plain[0].layer}.", f"model.layers.{layer}."
    return (
        [i._replace(name=i.name.replace(old, new, 1), layer=layer) for i in plain],
        [i._replace(name=i.name.replace(old, new, 1), layer=layer) for i in expert],
    )


def layer_items(cfg: ModelConfig, layers: list[int]) -> list[Item]:
    out: list[Item] = []
    for layer in layers:
        plain, expert = kind_items(cfg, layer)
        out += plain + expert
    return out


def _representatives(cfg: ModelConfig, funnel: SimSetup | None = None) -> list[Unit]:
    """One group per kind of tensor (first layer of its kind, expert 0) with its multiplicity, plus one
    reload-only group per layer kind (layer-wise reload completes once per layer).

    ``funnel`` (kvmove's own broadcast, ``SimSetup.funnel``): a tensor costs what its trainer pipeline stage and
    expert owner make it (a tensor trainer rank 0 does not hold goes to it first), so there is one group per kind
    per stage, and per trainer EP owner for experts."""
    pre, post = outer_items(cfg)
    out = [Unit([i], 1.0, 0, []) for i in pre]
    kinds: dict[str, list[int]] = {}
    for layer in range(cfg.num_hidden_layers):
        kinds.setdefault(layer_kind(cfg, layer), []).append(layer)
    stages = [range(cfg.num_hidden_layers)] if funnel is None else funnel.trainer.layout.stage_layers(cfg)
    owners = 1 if funnel is None else funnel.trainer.layout.ep
    for kind_layers in kinds.values():
        for stage in stages:
            members = [layer for layer in kind_layers if layer in stage]
            if not members:
                continue
            plain, expert = kind_items(cfg, members[0])
            n = float(len(members))
            out += [Unit([i], n, 0, []) for i in plain]
            for i in expert:
                per = i.experts // owners  # experts each trainer EP rank owns (one owner: all of them)
                first = i.expert0 or 0
                out += [Unit([i._replace(expert0=first + k * per, experts=1)], n * per, 0, []) for k in range(owners)]
            out.append(Unit([], n, 1, plain + expert))
    return out + [Unit([i], 1.0, 0, []) for i in post]


def host_owner(item: Item | None, world: int) -> int:
    """The rank of a host-memory trainer (a parameter server) that holds a non-expert tensor: spread over its
    ranks deterministically, by name (expert tensors are spread evenly over all ranks)."""
    if item is None:
        return 0
    return (sum(map(ord, item.name)) * 2654435761 + (item.layer or 0)) % world


def buckets(s: SimSetup) -> list[Unit]:
    """A bucketing broadcast sender's groups. Each source fills buckets of at most ``s.bucket_bytes`` wire bytes
    with its tensors in sync order (an expert block is split by experts to fit) and broadcasts one bucket at a
    time: a Megatron trainer's source is each pipeline stage's root; a host-memory trainer's are all of its ranks,
    each bucketing the bytes it holds (MoonshotAI checkpoint-engine's ``_gen_h2d_buckets``), so there are as many
    buckets as the ranks' bytes fill, spread here over the sync's tensors in order."""
    cfg = s.model
    pre, post = outer_items(cfg)
    items = pre + layer_items(cfg, list(range(cfg.num_hidden_layers))) + post
    if s.trainer.kind == "host":
        return _even(items, s, sum(-(-n // s.bucket_bytes) for n in _owner_bytes(items, s)))
    if s.trainer.kind != "megatron":
        return _fill(items, s)
    stages = s.trainer.layout.stage_layers(cfg)

    def stage(i: Item) -> int:
        if i.layer is None:
            return 0 if "embed" in i.name else len(stages) - 1
        return next(k for k, r in enumerate(stages) if i.layer in r)

    return [u for k in range(len(stages)) for u in _fill([i for i in items if stage(i) == k], s)]


def _wire(item: Item, s: SimSetup) -> int:
    return wire_bytes(item.name, item.shape, s.wire_dtype, s.block)


def _owner_bytes(items: list[Item], s: SimSetup) -> list[int]:
    world = s.trainer.world
    out = [0] * world
    for item in items:
        if not item.experts:
            out[host_owner(item, world)] += _wire(item, s)
            continue
        for o in range(world):
            out[o] += _wire(item, s) * ((o + 1) * item.experts // world - o * item.experts // world)
    return out


def _fill(items: list[Item], s: SimSetup) -> list[Unit]:
    """Items in order, greedily into buckets of at most ``s.bucket_bytes`` (an item alone when larger)."""
    groups: list[list[Item]] = [[]]
    room = s.bucket_bytes
    for item in _split(items, s, s.bucket_bytes):
        size = _wire(item, s) * item.tensors
        if groups[-1] and size > room:
            groups.append([])
            room = s.bucket_bytes
        groups[-1].append(item)
        room -= size
    return _with_layers(groups, s)


def _even(items: list[Item], s: SimSetup, n: int) -> list[Unit]:
    """Items in order, into ``n`` buckets of about equal bytes."""
    total = sum(_wire(i, s) * i.tensors for i in items)
    size = total / max(n, 1)
    groups: list[list[Item]] = [[]]
    at = 0.0
    for item in _split(items, s, int(size) + 1):
        if groups[-1] and at >= size * len(groups) and len(groups) < n:
            groups.append([])
        groups[-1].append(item)
        at += _wire(item, s) * item.tensors
    return _with_layers(groups, s)


def _split(items: list[Item], s: SimSetup, limit: int) -> list[Item]:
    """Expert blocks larger than ``limit`` bytes cut into runs of experts that fit."""
    out = []
    for item in items:
        each = _wire(item, s)
        if item.experts <= 1 or each * item.experts <= limit:
            out.append(item)
            continue
        step = max(1, limit // each)
        first = item.expert0 or 0
        for lo in range(0, item.experts, step):
            out.append(item._replace(expert0=first + lo, experts=min(step, item.experts - lo)))
    return out


def _with_layers(groups: list[list[Item]], s: SimSetup) -> list[Unit]:
    """Units; a decoder layer completes (for layer-wise reload) in the bucket holding its last item."""
    last = {i.layer: g for g, group in enumerate(groups) for i in group if i.layer is not None}
    done: dict[int, list[int]] = {}
    for layer, g in last.items():
        done.setdefault(g, []).append(layer)
    return [
        Unit(group, 1.0, len(done.get(g, [])), layer_items(s.model, done.get(g, []))) for g, group in enumerate(groups)
    ]


Demand = tuple[np.ndarray, np.ndarray, np.ndarray, int | None]
"""Who wants an item: (keeper local ranks, tensors each keeps, slice index each reads, trainer EP owner it reads
from)."""


def by_owner(keepers: np.ndarray, experts: int, owner_t: np.ndarray | None, index: np.ndarray) -> list[Demand]:
    """Split one keeper group's expert tensors by the trainer EP rank that owns them."""
    if owner_t is None:
        return [(keepers, np.full(len(keepers), float(experts)), index, None)]
    return [(keepers, np.full(len(keepers), float((owner_t == i).sum())), index, int(i)) for i in np.unique(owner_t)]
