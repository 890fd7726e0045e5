"""Real delta syncs (processes launcher, no Ray) of a trainer stepped by AdamW: every sync verified bit-exact
against the replayed checkpoint, through replicas dropped before and during syncs and rejoining."""

from __future__ import annotations

import sys

import pytest
import torch

from kvmove.cli.main import main
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Fault, Placement, SyncConfig
from kvmove.sync.delta.stepping import AdamwStep, SteppedSource
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.strategies import parse_strategies
from kvmove.transport import available_transports


def test_engines_equal_the_checkpoint_after_delta_syncs_with_dropped_and_rejoined_replicas() -> None:
    config = SyncConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=2,ep=2"),
        engine=EngineLayout.parse("tp=2", 2),
        strategies=tuple(parse_strategies("v3")),
        transport="nixl" if "nixl" in available_transports() else "gloo",
        syncs=6,
        verify=True,
        placement=Placement(launcher="processes"),
        faults=(Fault(1, 2), Fault(0, 5, during=True)),
        deadline_s=90.0,
        delta=True,
        source=SteppedSource(AdamwStep(lr=1e-6)),
    )
    results = list(run_syncs(config))
    assert all(r.verified for r in results), [(r.sync, r.mismatches) for r in results]
    first, killed, back, delta, mid, after = results
    assert first.delta["pulls"]["index"] == first.delta["pulls"]["bitmap"] == 0  # a first sync is dense
    assert killed.dead_replicas == (1,) and killed.delta["ratio"] < 0.5  # replica 0 takes a delta
    assert back.rejoined_replicas == (1,) and back.delta["pulls"]["dense"] > back.delta["dense_by_cost"]
    # the rejoined replica goes dense; replica 0 takes deltas but where its last delta measured costlier than dense
    # (kvmove.sync.delta.detect.Costs: timed, so on a busy host every one of its pulls may go dense by cost)
    assert 0 < back.delta["ratio"] < 1 or back.delta["dense_by_cost"] > 0
    # every pull a delta, but those whose last delta cost more than dense (kvmove.sync.delta.detect.Costs): the
    # rejoined replica's pulls, dense in sync 3, have no verdict yet and come as deltas
    assert delta.delta["pulls"]["dense"] == delta.delta["dense_by_cost"] and delta.delta["ratio"] < 0.75
    assert 0 < delta.delta["changed_fraction_all"] < 0.1
    assert set(delta.delta["changed_fraction"]) >= {"attention", "experts", "embeddings"}  # direct reads went packed
    assert mid.dead_replicas == (0,) and mid.live_engines == 2 and mid.pulls_before_kill
    assert after.rejoined_replicas == (0,) and after.delta["pulls"]["dense"] > 0  # killed half-way: dense again


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--full-every", "2"], "--full-every applies to delta syncs: add --delta"),
        (["--delta", "--dry-run"], "--delta"),
        (["--train-step", "sgd"], "sgd"),
    ],
)
def test_delta_options_are_refused_in_one_line(args: list[str], message: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["kvmove", "sync-weights", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_delta_syncs_on_one_gpu_colocated() -> None:
    """Trainer and engine process on cuda:0 over cuda-ipc: detection, encoding and the patch run on the device."""
    config = SyncConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=1"),
        engine=EngineLayout.parse("tp=1"),
        strategies=tuple(parse_strategies("v1,v3")),
        transport="cuda-ipc",
        syncs=3,
        verify=True,
        placement=Placement(launcher="processes", trainer_devices=("cuda:0",), colocated=True),
        delta=True,
        source=SteppedSource(AdamwStep(lr=1e-6)),
    )
    results = list(run_syncs(config))
    assert all(r.verified for r in results)
    assert all(r.delta["ratio"] < 0.2 for r in results if r.sync == 2)  # the first delta sync: every pull a delta
    # later, a pull whose delta cost more than packing it (inside one GPU, where no link binds) goes dense by cost
    assert all(r.delta["pulls"]["dense"] == r.delta["dense_by_cost"] for r in results if r.sync > 2)
