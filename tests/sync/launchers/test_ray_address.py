"""``RAY_ADDRESS`` as Ray's own tools read it: a sync joins a real Ray head started on loopback (as under
``ray job submit``); ``--ray-address`` wins over it; the processes launcher does not use Ray at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmove.cli.main import main
from kvmove.ports import free_port

LOOPBACK = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture()
def ray_head(tmp_path: Path) -> Iterator[str]:
    """A Ray head on loopback in its own process group (ours to end), stopped by signalling that group."""
    pytest.importorskip("ray")
    port = free_port()
    ray = Path(sys.executable).with_name("ray")
    cmd = [str(ray), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1"]
    cmd += ["--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats"]
    log = (tmp_path / "ray-head.log").open("w")
    head = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | LOOPBACK, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "now block forever" not in (tmp_path / "ray-head.log").read_text():
            assert head.poll() is None, (tmp_path / "ray-head.log").read_text()[-2000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head drains and stops every process it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()


def test_a_sync_joins_the_cluster_named_by_RAY_ADDRESS(ray_head: str) -> None:
    args = ["sync-weights", "--trainer", "tp=2", "--engine", "tp=1", "--replicas", "1", "--strategy", "v2"]
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ray_head}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # kvmove itself keeps a loopback address on loopback
    cmd = [sys.executable, "-m", "kvmove.cli.main", *args, "--verify", "--json", "--no-record"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["verified"] is True and row["launcher"] == "ray"
    assert f"Connecting to existing Ray cluster at address: {ray_head}" in done.stderr


def _closed_port() -> str:
    return f"127.0.0.1:{free_port()}"


def test_ray_address_option_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    named, env = _closed_port(), _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", env)
    monkeypatch.setattr(sys, "argv", ["kvmove", "sync-weights", "--ray-address", named, "--no-record"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and f"cannot reach a Ray cluster at {named}" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["kvmove", "sync-weights", "--no-record"])
    with pytest.raises(SystemExit):
        main()
    assert f"cannot reach a Ray cluster at {env}" in capsys.readouterr().err


def test_the_processes_launcher_ignores_RAY_ADDRESS_and_refuses_ray_address(monkeypatch, capsys) -> None:
    from kvmove.cli import sync

    monkeypatch.setenv("RAY_ADDRESS", _closed_port())
    assert sync._ray_address_env("processes") is None
    monkeypatch.setattr(sys, "argv", ["kvmove", "sync-weights", "--launcher", "processes", "--ray-address", "x:1"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and "does not use" in capsys.readouterr().err


def test_a_local_ray_that_misses_its_start_up_is_one_line_and_exit_2(monkeypatch, capsys) -> None:
    import ray

    def timed_out(*args: object, **kwargs: object) -> None:  # what Ray raises on a machine too loaded to start it
        raise Exception("The current node timed out during startup.\nsecond line")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.setattr(sys, "argv", ["kvmove", "sync-weights"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Ray could not start (a local instance): The current node timed out" in err
    assert "Traceback" not in err and "second line" not in err
