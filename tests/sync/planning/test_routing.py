from __future__ import annotations

import pytest

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.sync.planning.ownership import Ownership, shard_rule
from kvmove.sync.planning.plan import plan_engine
from kvmove.sync.planning.routing import route
from kvmove.sync.strategies import STRATEGIES


@pytest.mark.parametrize(
    ("model", "trainer", "engine", "replicas", "scope"),
    [
        ("qwen3-235b-a22b", "tp=4,pp=2,ep=8,dp=2", "dp=16,ep=16", 1, "v2"),
        ("qwen3-235b-a22b", "tp=4,pp=2,ep=8,dp=2", "dp=16,ep=16", 1, "v1"),
        ("qwen3-moe-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2", 2, "v2"),
        ("kimi-k2-tiny", "tp=2,ep=2,dp=2", "tp=4,ep=4", 2, "v2"),
    ],
)
def test_load_balance_and_every_source_holds_its_region(model, trainer, engine, replicas, scope) -> None:
    cfg = resolve_model(model)
    tl, el = TrainerLayout.parse(trainer), EngineLayout.parse(engine, replicas)
    plans = plan_engine(cfg, el)
    own = Ownership(cfg, tl)
    smap = route(plans, el, own, STRATEGIES[scope])
    assert smap.balance <= 1.25
    for e in range(el.world):
        for region, rank in zip(plans[el.coord(e).local].regions, smap.sources[e], strict=True):
            assert rank in own.holders(region.hf_name, STRATEGIES[scope].scope)
    assert sum(smap.bytes_per_trainer) == sum(smap.bytes_per_engine)


def test_broadcast_serves_everything_from_rank_zero() -> None:
    cfg = resolve_model("qwen3-moe-tiny")
    el = EngineLayout.parse("tp=2")
    plans = plan_engine(cfg, el)
    smap = route(plans, el, Ownership(cfg, TrainerLayout.parse("tp=2,pp=2")), STRATEGIES["broadcast"])
    assert {r for srcs in smap.sources for r in srcs} == {0}


def test_experts_are_pulled_from_their_ep_owner_under_v2() -> None:
    cfg = resolve_model("qwen3-235b-a22b")
    tl = TrainerLayout.parse("tp=4,pp=2,ep=8,dp=2")
    own = Ownership(cfg, tl)
    rule = shard_rule(cfg, tl, "model.layers.60.mlp.experts.37.down_proj.weight")
    assert rule.stage == 1 and rule.expert == 37
    holders = own.holders("model.layers.60.mlp.experts.37.down_proj.weight", "stage")
    assert [tl.coord(r).ep for r in holders] == [37 // 16] and tl.coord(holders[0]).pp == 1


@pytest.mark.parametrize(("trainer",), [("tp=2,pp=2,ep=2",), ("tp=2,ep=4,etp=2,dp=4",), ("tp=2,pp=3,ep=4,dp=2",)])
def test_raw_slices_tile_every_tensor_once_per_replica(trainer: str) -> None:
    cfg = resolve_model("qwen3-moe-tiny")
    tl = TrainerLayout.parse(trainer)
    tl.validate(cfg)
    own = Ownership(cfg, tl)
    for t in hf_tensors(cfg):
        held = sum(h.box.numel for h in own.slices(t))
        assert held % t.numel == 0 and held >= t.numel, t.name
