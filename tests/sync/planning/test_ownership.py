from __future__ import annotations

from kvmove.models import resolve_model
from kvmove.models.layout import TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.sync.planning.ownership import Ownership


def _boxes_cut(monkeypatch, layers: int) -> int:
    cfg = resolve_model("qwen3-moe-tiny", {"num_hidden_layers": layers})
    own = Ownership(cfg, TrainerLayout.parse("tp=2,ep=2,dp=2"))
    calls = []
    cut = own._box
    monkeypatch.setattr(own, "_box", lambda *a: calls.append(a) or cut(*a))
    for t in hf_tensors(cfg):
        assert own.slices(t), t.name
    return len(calls)


def test_shard_boxes_are_cut_once_per_kind_of_tensor_not_per_layer(monkeypatch) -> None:
    """Tensors alike (shape, split, owners) share their raw shards: a model of 8 layers cuts no more boxes than one
    of 2 (Kimi K2's 70k tensors: a few hundred cuts)."""
    assert _boxes_cut(monkeypatch, 8) == _boxes_cut(monkeypatch, 2) > 0


def test_tensors_alike_hold_alike_boxes_and_differ_by_name_only() -> None:
    cfg = resolve_model("qwen3-moe-tiny")
    layout = TrainerLayout.parse("tp=2,ep=2,dp=2")
    shared, alone = Ownership(cfg, layout), Ownership(cfg, layout)
    for t in hf_tensors(cfg):
        fresh = tuple(alone._slices.pop(t.name, None) or alone.slices(t))
        alone._alike.clear()  # every tensor's boxes cut anew
        assert shared.slices(t) == fresh, t.name
