"""Dry-run plans replayed on seeded weights are bit-exact against the loader fed full tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import SyncConfig
from kvmove.sync.driver.dryrun import build_plans, dry_run_sync
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.planning.routing import route
from kvmove.sync.strategies import STRATEGIES
from kvmove.sync.verify import verify_plans

# (model, trainer, engine, replicas): covers tp > kv heads, etp > 1, uneven pp, engine tp=1 with dp·ep,
# replicas > 1, MLA, tied embeddings with biases, dense models.
PAIRS = [
    ("qwen3-moe-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2", 2),
    ("qwen3-moe-tiny", "tp=1", "tp=1", 1),
    ("qwen3-moe-tiny", "tp=2,pp=3,ep=2", "tp=4", 1),  # 4 layers over 3 stages; tp > kv heads
    ("qwen3-moe-tiny", "tp=2,ep=2,etp=2,dp=2", "dp=4,ep=4", 1),  # etp > 1; engine tp=1 with dp·ep
    ("qwen3-moe-tiny", "tp=2,pp=2,ep=4,dp=2", "tp=1,dp=8,ep=8", 1),
    ("qwen3-moe-tiny", "tp=1,pp=4", "tp=2,pp=2", 3),
    ("qwen3-moe-tiny", "tp=2,etp=2", "tp=4,dp=2,ep=8", 1),
    ("kimi-k2-tiny", "tp=2,pp=3,ep=4,dp=2", "tp=4,ep=4", 1),
    ("kimi-k2-tiny", "tp=4,pp=2,ep=2,etp=2", "dp=4,ep=4", 2),
    ("kimi-k2-tiny", "tp=1,pp=2", "tp=2,pp=3", 1),
    ("kimi-k2-tiny", "tp=2,ep=2", "tp=2,dp=2,ep=4", 1),
    ("qwen3-tiny", "tp=2,pp=2", "tp=4", 2),
    ("qwen2-tiny", "tp=2,pp=2", "tp=2,pp=2", 2),
    ("qwen2-tiny", "tp=2,pp=3", "tp=4,pp=2", 1),
    # architectures whose tables come from transformers' own models (dims off the powers of two)
    ("llama3-tiny", "tp=2,pp=2", "tp=2", 2),  # GQA 6 heads over 2 KV heads
    ("mistral-tiny", "tp=2", "tp=2,pp=3", 1),
    ("gemma2-tiny", "tp=2,pp=3", "tp=2,pp=2", 1),  # tied embeddings, four norms per layer
    ("mixtral-tiny", "tp=2,pp=3,ep=2", "tp=2,ep=2", 1),  # block_sparse_moe.experts.E.w1/w2/w3
    ("glm4-moe-tiny", "tp=2,ep=2,etp=2", "tp=2", 2),  # first dense layer, shared experts, router bias
    # experts fused in the checkpoint: [E, in, out] tensors cut over EP (dim 0) and ETP (gate/up interleaved)
    ("gpt-oss-tiny", "tp=2,ep=2,etp=2", "tp=2", 1),  # sinks, biases, each rank's box cut on two dims
    ("llama4-tiny", "tp=2,pp=3,ep=2", "tp=2", 2),  # gate/up in halves, MoE every second layer, shared expert
    ("llama4-tiny", "tp=1,ep=2", "dp=2,ep=2", 1),  # whole experts on both sides
]


@pytest.mark.parametrize(("model", "trainer", "engine", "replicas"), PAIRS)
def test_dry_run_verify_bit_exact(model: str, trainer: str, engine: str, replicas: int) -> None:
    config = SyncConfig(
        model=resolve_model(model),
        trainer=TrainerLayout.parse(trainer),
        engine=EngineLayout.parse(engine, replicas),
        strategies=tuple(STRATEGIES.values()),
        verify=True,
        seed=3,
    )
    reports = dry_run_sync(config)
    assert [r.strategy for r in reports] == list(STRATEGIES)
    for r in reports:
        assert r.verified is True, r.mismatches
        assert r.engine_ranks == config.engine.world


def test_verification_catches_a_corrupted_plan() -> None:
    config = SyncConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=2,ep=2"),
        engine=EngineLayout.parse("tp=2"),
        strategies=(STRATEGIES["v2"],),
    )
    plans, _ = build_plans(config)
    ownership = Ownership(config.model, config.trainer)
    # swap where the gate and up slices of one layer land: every byte arrives, in the wrong place
    regions = list(plans[0].regions)
    ig = next(i for i, r in enumerate(regions) if r.hf_name == "model.layers.0.mlp.gate_proj.weight")
    iu = next(i for i, r in enumerate(regions) if r.hf_name == "model.layers.0.mlp.up_proj.weight")
    gate, up = regions[ig], regions[iu]
    regions[ig], regions[iu] = gate._replace(dst=up.dst), up._replace(dst=gate.dst)
    bad = (ShardingPlan(plans[0].coord, tuple(regions), plans[0].params), *plans[1:])
    smap = route(bad, config.engine, ownership, STRATEGIES["v2"])
    result = verify_plans(config.model, config.engine, bad, ownership, smap, "stage")
    assert not result.ok
    assert result.mismatches == ("engine rank 0: model.layers.0.mlp.gate_up_proj.weight",)
    good = verify_plans(
        config.model, config.engine, plans, ownership, route(plans, config.engine, ownership, STRATEGIES["v2"]), "stage"
    )
    assert good.ok and good.params_checked == 2 * len(plans[0].params)


def test_the_cycle_collector_is_paused_while_planning_and_restored_after(monkeypatch) -> None:
    import gc

    from kvmove.sync.driver import dryrun

    seen = []
    plan = dryrun.build_plans
    monkeypatch.setattr(dryrun, "build_plans", lambda c: seen.append(gc.isenabled()) or plan(c))
    config = SyncConfig(
        model=resolve_model("qwen3-tiny"),
        trainer=TrainerLayout.parse("tp=2"),
        engine=EngineLayout.parse("tp=2"),
        strategies=(STRATEGIES["v2"],),
    )
    assert gc.isenabled()
    assert [r.strategy for r in dryrun.dry_run_sync(config)] == ["v2"]
    assert seen == [False] and gc.isenabled()


def test_broadcast_is_routed_only_to_be_verified(monkeypatch) -> None:
    from kvmove.sync.driver import dryrun

    routed = []
    real = dryrun.route
    monkeypatch.setattr(
        dryrun,
        "route",
        lambda plans, layout, own, s, *a, **k: routed.append(s.name) or real(plans, layout, own, s, *a, **k),
    )
    config = SyncConfig(
        model=resolve_model("qwen3-tiny"),
        trainer=TrainerLayout.parse("tp=2"),
        engine=EngineLayout.parse("tp=2"),
        strategies=(STRATEGIES["v1"], STRATEGIES["broadcast"]),
    )
    plain = dryrun.dry_run_sync(config)
    assert routed == ["v1"]
    verified = dryrun.dry_run_sync(replace(config, verify=True))
    assert routed == ["v1", "v1", "broadcast"] and all(r.verified for r in verified)
    assert [r._replace(plan_seconds=0, verified=None) for r in verified] == [
        r._replace(plan_seconds=0) for r in plain
    ]  # the same bytes, routed or not


def test_the_plans_are_freed_before_the_collector_resumes(monkeypatch) -> None:
    import weakref
    from contextlib import contextmanager

    from kvmove.sync.driver import dryrun

    owned: list[weakref.ref] = []
    alive_at_resume: list[bool] = []
    real_ownership, real_paused = dryrun.Ownership, dryrun._collector_paused

    def ownership(*args):
        made = real_ownership(*args)
        owned.append(weakref.ref(made))
        return made

    @contextmanager
    def paused():
        with real_paused():
            yield
            alive_at_resume.append(owned[0]() is not None)

    monkeypatch.setattr(dryrun, "Ownership", ownership)
    monkeypatch.setattr(dryrun, "_collector_paused", paused)
    config = SyncConfig(
        model=resolve_model("qwen3-tiny"),
        trainer=TrainerLayout.parse("tp=2"),
        engine=EngineLayout.parse("tp=2"),
        strategies=(STRATEGIES["v2"],),
    )
    assert len(dryrun.dry_run_sync(config)) == 1
    assert alive_at_resume == [False]
