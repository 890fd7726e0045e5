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


def _greedy(plans, layout, ownership, strategy, direct=None, devices=None):
    """The router's rule spelled out job by job (the oracle the bulk router must match): entries with one possible
    source first, then largest first (ties by engine rank, entry, piece order), each to the least-loaded candidate
    (ties to the lowest rank), on the engine rank's own device where a candidate is."""
    from kvmove.sync.planning.entries import plan_entries

    entries = plan_entries(plans, ownership, strategy, direct, direct is not None)
    jobs = []
    for e in range(layout.world):
        for i, entry in enumerate(entries[layout.coord(e).local].entries):
            whole = [(entry.nbytes, entry.holders, None)]
            parts = [(p.region.nbytes, p.holders, p.region) for p in entry.pieces] or whole
            jobs += [(len(h) > 1, -n, e, i, k, h, piece) for k, (n, h, piece) in enumerate(parts)]
    jobs.sort(key=lambda j: j[:5])
    loads = [0] * ownership.world
    sources = [[-1] * len(entries[layout.coord(e).local].entries) for e in range(layout.world)]
    pieces: dict = {}
    for _, neg, e, i, _, cands, piece in jobs:
        near = tuple(r for r in cands if devices is None or devices.is_local(e, r)) or cands
        rank = min(near, key=lambda r: (loads[r], r))
        loads[rank] -= neg
        if piece is not None:
            pieces.setdefault((e, i), []).append((rank, piece))
        if sources[e][i] < 0:
            sources[e][i] = rank
    return tuple(map(tuple, sources)), tuple(loads), {k: tuple(v) for k, v in pieces.items()}


class _EveryThird:
    """A device map where engine rank e shares a device with trainer ranks r, (e + r) % 3 == 0."""

    def is_local(self, engine: int, trainer: int) -> bool:
        return (engine + trainer) % 3 == 0


@pytest.mark.parametrize(
    ("model", "trainer", "engine", "replicas"),
    [("qwen3-moe-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2", 3), ("qwen3-tiny", "tp=2", "tp=4", 2)],
)
@pytest.mark.parametrize("devices", [None, _EveryThird()])
def test_bulk_routing_matches_the_greedy_rule_job_by_job(model, trainer, engine, replicas, devices) -> None:
    from kvmove.sync.planning.direct import DirectPlanner

    cfg = resolve_model(model)
    tl, el = TrainerLayout.parse(trainer), EngineLayout.parse(engine, replicas)
    plans, own = plan_engine(cfg, el), Ownership(cfg, tl)
    direct = DirectPlanner(own, hf_tensors(cfg))
    for s in STRATEGIES.values():
        d = direct if s.direct else None
        smap = route(plans, el, own, s, d, devices=devices, shard_reads=d is not None)
        assert (smap.sources, smap.bytes_per_trainer, smap.pieces) == _greedy(plans, el, own, s, d, devices), s.name


def test_each_local_rank_is_listed_once_whatever_the_replicas(monkeypatch) -> None:
    """Replicas are identical: their jobs are one local rank's, repeated (routing work does not grow per replica
    beyond the greedy choices themselves)."""
    from kvmove.sync.planning import routing

    cfg = resolve_model("qwen3-moe-tiny")
    el = EngineLayout.parse("tp=2,ep=2", 4)
    plans, own = plan_engine(cfg, el), Ownership(cfg, TrainerLayout.parse("tp=2,ep=2"))
    calls = []
    listed = routing._local_jobs
    monkeypatch.setattr(routing, "_local_jobs", lambda plan, *a: calls.append(plan) or listed(plan, *a))
    smap = route(plans, el, own, STRATEGIES["v2"])
    assert len(calls) == el.ranks_per_replica and len(smap.sources) == el.world
