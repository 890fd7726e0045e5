"""Placement and transport choices that cannot run are one line and exit code 2, before any rank starts."""

from __future__ import annotations

import sys

import pytest

from kvmove.cli.main import main


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmove.sync import launchers

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("a launcher started")

    for cls in launchers.LAUNCHERS.values():
        monkeypatch.setattr(cls, "__init__", never)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer-devices", "gpu0"], "--trainer-devices 'gpu0': devices are cpu, cuda or cuda:N"),
        (["--engine-devices", ""], "--engine-devices '': devices are cpu, cuda or cuda:N"),
        (["--engine-devices", "cuda:7"], "device cuda:7 does not exist here"),
        (["--placement", "colocated"], "--placement colocated (trainer and engine ranks sharing devices) is not built"),
        (["--placement", "shared"], "'shared' is not one of 'disaggregated', 'colocated'"),
        (["--launcher", "slurm"], "'slurm' is not one of 'ray', 'processes'"),
        (["--dry-run", "--launcher", "processes"], "--launcher does not apply to --dry-run"),
        (["--launcher", "processes", "--transport", "object-store"], "lives in Ray actors: use --launcher ray"),
        (["--launcher", "processes", "--transport", "cuda-ipc"], "does not move cpu buffers"),
        (["--fail-trainer", "0@1:late"], "--fail-trainer '0@1:late' is not RANK@SYNC or RANK@SYNC:mid"),
    ],
)
def test_refused_in_one_line(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["kvmove", "sync-weights", "--no-record", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and message in lines[0], lines
