"""Faults at the driver's named points: refused up front when they name nothing, a dead trainer rank ends the run
in one line as soon as it is seen, deterministic hooks (pure)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Fault, Placement, Side, SyncConfig
from kvmove.sync.driver.faults import FaultHooks
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.driver.step import RunFailed
from kvmove.sync.strategies import parse_strategies


def _config(**kw: object) -> SyncConfig:
    base: dict[str, object] = dict(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=2,ep=2"),
        engine=EngineLayout.parse("tp=1", 2),
        strategies=tuple(parse_strategies("v2")),
        transport="gloo",
        syncs=2,
        verify=True,
        deadline_s=60.0,
    )
    base.update(kw)
    return SyncConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fault", "strategies", "message"),
    [
        (Fault(9, 1), "v2", r"--fail-engine 9@1: there is no replica 9 \(0\.\.1 exist\)"),
        (Fault(1, 3), "v2", r"--fail-engine 1@3: the run has 2 sync\(s\) per strategy"),
        (Fault(2, 1, side=Side.TRAINER), "v2", r"--fail-trainer 2@1: there is no trainer rank 2 \(0\.\.1 exist\)"),
        (Fault(0, 1, during=True), "v2,broadcast", r"broadcast baseline is one collective"),
        (Fault(0, 1), "v2", r"fault injection needs a transport a restarted replica can rejoin"),
    ],
)
def test_faults_that_cannot_happen_are_refused_before_anything_starts(
    fault: Fault, strategies: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmove.sync import launchers

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("a launcher started")

    for cls in launchers.LAUNCHERS.values():
        monkeypatch.setattr(cls, "__init__", never)
    transport = "gloo" if "rejoin" in message else "nixl" if "nixl" in _available() else "object-store"
    config = _config(faults=(fault,), strategies=tuple(parse_strategies(strategies)), transport=transport)
    with pytest.raises(KvmoveError, match=message):
        list(run_syncs(config))


def _available() -> list[str]:
    from kvmove.transport import available_transports

    return available_transports()


def test_fault_hooks_strike_half_way_whatever_the_sync_length() -> None:
    engine = EngineLayout.parse("tp=2", 2)
    hooks = FaultHooks((Fault(1, 2, during=True), Fault(0, 1), Fault(1, 2, True, Side.TRAINER)), engine)
    assert hooks.before(1, Side.ENGINE) == [0] and hooks.before(2, Side.ENGINE) == []
    # replica 1 = engine ranks 2, 3: its first live rank dies after half its pulls, at least one
    assert hooks.engine_deaths(2, {0, 1, 2, 3}, {2: 7, 3: 7}) == {2: 3}
    assert hooks.engine_deaths(2, {0, 1, 3}, {3: 1}) == {3: 1}
    assert hooks.engine_deaths(1, {0, 1, 2, 3}, {2: 7}) == {}
    assert hooks.trainer_deaths(2, {1: 5}) == {1: 2} and hooks.trainer_deaths(2, {1: 0}) == {1: 0}


def test_a_trainer_rank_killed_mid_sync_ends_the_run_in_one_line_at_once() -> None:
    marks: list[float] = []

    def progress(message: str) -> None:
        if "sync 1/" in message:
            marks.append(time.monotonic())

    config = _config(faults=(Fault(1, 1, during=True, side=Side.TRAINER),), placement=Placement("processes"))
    with pytest.raises(RunFailed) as caught:
        list(run_syncs(config, progress))
    seen = time.monotonic() - marks[0]
    message = str(caught.value)
    assert "\n" not in message and message.startswith("trainer rank 1 killed by a fault at v2 sync 1"), message
    assert seen < config.deadline_s / 2, f"{seen:.1f} s: the driver waited for a deadline instead of seeing the death"


def test_cli_a_dead_trainer_rank_is_one_error_line_and_exit_1() -> None:
    args = ["--launcher", "processes", "--transport", "gloo", "--trainer", "tp=2", "--engine", "tp=1"]
    args += ["--replicas", "1", "--strategy", "v2", "--fail-trainer", "0@1:mid", "--no-record", "--json"]
    cmd = [sys.executable, "-m", "kvmove.cli.main", "sync-weights", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvmove: ")]
    errors = [line for line in errors if not line.startswith("kvmove: [")]  # progress lines
    assert done.returncode == 1, done.stderr[-2000:]
    assert errors == [errors[0]] and errors[0].startswith("kvmove: failed: trainer rank 0 killed by a fault")
    assert "Traceback" not in done.stderr and done.stdout == ""
