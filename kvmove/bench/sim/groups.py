"""How a strategy groups the checkpoint's tensors: one group per tensor, per pipeline stage or per decoder block.

Experts of one projection of one layer form one item (they move together); per-tensor grouping keeps one
representative per kind of tensor with its multiplicity (every layer of a kind, every expert, costs the same).
"""

from __future__ import annotations

from typing import NamedTuple

from kvmove.bench.sim.setup import SimSetup
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
    """The groups of ``strategy`` on ``s``, in sync order."""
    cfg = s.model
    if strategy.grouping == "tensor":
        return _representatives(cfg)
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


def _representatives(cfg: ModelConfig) -> list[Unit]:
    """One group per kind of tensor (first layer of its kind, expert 0) with its multiplicity, plus one
    reload-only group per layer kind (layer-wise reload completes once per layer)."""
    pre, post = outer_items(cfg)
    out = [Unit([i], 1.0, 0, []) for i in pre]
    kinds: dict[str, list[int]] = {}
    for layer in range(cfg.num_hidden_layers):
        kinds.setdefault(layer_kind(cfg, layer), []).append(layer)
    for members in kinds.values():
        plain, expert = kind_items(cfg, members[0])
        n = float(len(members))
        out += [Unit([i], n, 0, []) for i in plain]
        out += [Unit([i._replace(experts=1)], n * i.experts, 0, []) for i in expert]
        out.append(Unit([], n, 1, plain + expert))
    return out + [Unit([i], 1.0, 0, []) for i in post]
