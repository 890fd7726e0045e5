"""The simulator against the published figures, the plans' bytes, speed of light and bad topologies."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvmove.bench import simulator as S
from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models import resolve_model
from kvmove.models.tensors import hf_tensors
from kvmove.sync.plan import plan_engine

QWEN, KIMI = S.SETUPS["qwen3-235b"], S.SETUPS["kimi-k2"]
AIMED = [f for f in S.FIGURES if f.strategy != "broadcast"]


def _layouts(setup: S.Setup) -> tuple:
    return (
        resolve_model(setup.model),
        TrainerLayout.parse(setup.trainer),
        EngineLayout.parse(setup.engine, setup.replicas),
    )


@pytest.fixture(scope="module")
def published() -> dict[tuple[str, str], S.Prediction]:
    return {
        (s.name, p.strategy): p
        for s, strategies in ((QWEN, ["v1", "v2", "v3", "broadcast"]), (KIMI, ["v3"]))
        for p in S.simulate_setup(s, strategies, S.PUBLISHED)
    }


@pytest.mark.parametrize("figure", AIMED, ids=lambda f: f"{f.setup}-{f.strategy}-{f.metric}")
def test_simulated_within_25_percent_of_published(published, figure: S.Figure) -> None:
    simulated = S.figure_value(published[(figure.setup, figure.strategy)], figure.metric)
    assert abs(simulated / figure.value - 1) <= 0.25, (figure, simulated)


def test_kimi_bytes_are_the_plans_and_the_published_7899_gib(published) -> None:
    p = published[("kimi-k2", "v3")]
    cfg, _, engine = _layouts(KIMI)
    assert p.bytes_total == sum(pl.nbytes for pl in plan_engine(cfg, engine)) * engine.replicas == 8_481_498_595_328
    assert round(p.bytes_total / 2**30) == 7899  # the post's "7.9 TB" and "1,049 GB/s" are GiB
    assert 1.2 < p.seconds / p.serial_pp_speed_of_light_seconds < 1.7  # "~1.5x the speed of light"


def test_bytes_exact_against_routing() -> None:
    cfg, trainer, engine = _layouts(QWEN)
    for strategy in ("v1", "v2", "v3"):
        t = S.traffic(cfg, trainer, engine, strategy)
        assert t.bytes_total == int(t.send[2].sum()) == int(t.recv[2].sum()) == 710_104_432_640
    b = S.traffic(cfg, trainer, engine, "broadcast")
    assert b.bytes_total == sum(x.nbytes for x in hf_tensors(cfg)) * engine.world


@pytest.mark.parametrize("constraints", [S.PUBLISHED, S.KVMOVE], ids=["published", "kvmove"])
def test_never_faster_than_speed_of_light(constraints: S.Constraints) -> None:
    for p in S.simulate_setup(QWEN, ["v1", "v2", "v3", "broadcast"], constraints):
        assert p.seconds >= p.speed_of_light_seconds > 0
        if constraints.serial_pp:
            assert p.seconds >= p.serial_pp_speed_of_light_seconds
        assert set(p.phases) == set(S.PHASES)


def test_kvmove_v3_beats_published_and_nears_speed_of_light(published) -> None:
    for setup in (QWEN, KIMI):
        (mine,) = S.simulate_setup(setup, ["v3"], S.KVMOVE)
        assert mine.seconds < published[(setup.name, "v3")].seconds
        assert 1.0 <= mine.sol_ratio < 1.5


@pytest.mark.parametrize("strategy", ["v1", "v2", "v3", "broadcast"])
def test_more_nic_bandwidth_is_never_slower(strategy: str) -> None:
    cfg, trainer, engine = _layouts(QWEN)
    times = []
    for nic in (100, 200, 400, 800, 1600):
        top = S.Topology.parse(f"gpus_per_node=8,nic_gbps={nic},nvlink_gbps=450,pcie_gbps=1000")
        (p,) = S.simulate(cfg, trainer, engine, [strategy], top, 2, 2, S.PUBLISHED)
        times.append(p.seconds)
    assert times == sorted(times, reverse=True)


def test_topology_that_cannot_hold_the_layouts() -> None:
    cfg, trainer, engine = _layouts(QWEN)
    top = S.Topology.parse("gpus_per_node=8,nic_gbps=400,nvlink_gbps=450")
    with pytest.raises(KvmoveError, match="trainer layout needs 16 GPUs but 1 node"):
        S.simulate(cfg, trainer, engine, ["v3"], top, 1, 2)
    with pytest.raises(KvmoveError, match="engine layout needs 16 GPUs"):
        S.simulate(cfg, trainer, engine, ["v3"], S.Topology.parse("gpus_per_node=4"), 4, 2)


@pytest.mark.parametrize(
    ("spec", "match"),
    [("gpus_per_node=8,fast=1", "not one of"), ("nic_gbps=abc", "must be a number"), ("nic_gbps=-1", "positive")],
)
def test_bad_cluster_spec(spec: str, match: str) -> None:
    with pytest.raises(KvmoveError, match=match):
        S.Topology.parse(spec)


def test_topology_units() -> None:
    top = S.Topology.parse("gpus_per_node=8,nic_gbps=400,nvlink_gbps=450")
    assert top.gpu_nic_rate == 50e9 and top.node_nic_rate == 400e9 and top.nics_per_node == 8
    assert S.Topology.parse("gpus_per_node=8,nic_gbps=400,nics_per_node=4").gpu_nic_rate == 25e9


def test_fit_recovers_the_default_costs() -> None:
    base = S.Costs()
    fitted = S.fit_costs(base, efficiencies=(0.8, 0.85, 0.9), reloads=(0.030, 0.034, 0.038))
    assert (fitted.nic_efficiency, fitted.reload_module_s) == (base.nic_efficiency, base.reload_module_s)


def _sync_row(hardware: str, pack: float) -> dict:
    return {
        "kind": "measured",
        "suite": "sync",
        "hardware": hardware,
        "model": "qwen3-moe-tiny",
        "trainer": "tp=2,pp=2,ep=2,etp=1,dp=1",
        "engine": "tp=2,dp=1,ep=2,pp=1 x2",
        "strategy": "v3",
        "phases": json.dumps({"pack": pack}),
    }


def test_calibration_applies_gpu_rows_and_only_reports_cpu_rows() -> None:
    assert S.calibrate(None).costs == S.Costs()
    cpu = S.calibrate(pd.DataFrame([_sync_row("cpu:AMD EPYC x2", 0.05)]))
    assert cpu.costs == S.Costs() and "not applied" in cpu.sources["replay_region_s"]
    gpu = S.calibrate(pd.DataFrame([_sync_row("gpu:NVIDIA H200 x2", 0.0044)]))
    assert gpu.costs.replay_region_s != S.Costs().replay_region_s
    assert gpu.sources["replay_region_s"].startswith("measured")


def test_cli_simulate_json_keys() -> None:
    from kvmove.cli.report import simulate

    cfg, trainer, engine = _layouts(QWEN)
    rows = simulate(cfg, trainer, engine, ["v2", "v3"], "gpus_per_node=8,nic_gbps=400,nvlink_gbps=450", 2, 2)
    assert [r["strategy"] for r in rows] == ["v2", "v3"]
    for r in rows:
        assert {"strategy", "seconds", "bytes_total", "speed_of_light_seconds", "simulated"} <= set(r)
        assert r["simulated"] is True and r["bytes_total"] == 710_104_432_640


def test_rows_are_labelled_simulated() -> None:
    (p,) = S.simulate_setup(QWEN, ["v3"], S.PUBLISHED)
    row = S.prediction_row(p, QWEN, S.calibrate())
    assert row.kind == "simulated" and row.extra["published"] == {"seconds": 3.49}
    assert row.link_limit_gbps == pytest.approx(p.bytes_total / p.speed_of_light_seconds / 1e9)
