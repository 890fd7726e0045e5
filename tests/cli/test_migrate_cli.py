"""`kvmove migrate` and `kvmove serve` from the command line (real subprocess servers on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from kvmove.cli.main import main
from kvmove.transport import TRANSPORTS


def _kvmove(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmove.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["kvmove", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
        sys.exit(0)
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


@pytest.mark.parametrize("cmd", ["serve", "migrate"])
def test_help_has_examples(monkeypatch, capsys, cmd: str) -> None:
    code, out, _ = _main(monkeypatch, capsys, cmd, "--help")
    assert code == 0 and "Example:" in out


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nixl", "http"])
def test_migrate_json_verifies_and_reports(tmp_path, transport: str) -> None:
    if not TRANSPORTS[transport].is_available():
        pytest.skip(f"{transport} is not installed")
    args = ["migrate", "--transport", transport, "--workers", "2", "--requests", "2", "--prompt-len", "16"]
    args += ["--new-tokens", "8"]
    args += ["--num-pages", "32", "--page-size", "4", "--json", "--no-baseline", "--no-measure-link"]
    # NOTE: the skewed workload is timing-dependent (a high-priority request admitted locally before the
    # controller sees it starve is not moved), so a run that happened to need no migration is retried.
    for _ in range(3):
        out = _kvmove(*args, "--results", str(tmp_path))
        lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        if out.returncode == 0 and lines and lines[-1].get("migrations", 0) >= 1:
            break
    assert out.returncode == 0, out.stderr[-3000:]
    summary = lines[-1]
    assert {"migrations", "verified", "bytes", "seconds", "gbps", "integrity_ok"} <= set(summary)
    assert summary["migrations"] >= 1 and summary["verified"] and summary["integrity_ok"]
    assert summary["transport"] == transport and summary["transport_fallback"] is False
    moved = [x for x in lines[:-1] if x["migrations"]]
    assert all(x["transport"] == transport for x in moved), lines
    page = 512 * 8  # one page of 4 tokens in the 8 host buffers
    first = moved[0]
    assert first["matched_tokens"] == 0 and first["bytes"] >= 4 * page, "the first move carries the prompt's 4 pages"
    # NOTE: how many pages a request computed before it was held (the prompt's, plus some decoded on the busy
    # worker) is timing; that each move carried exactly the pages the target lacked is not (dedup: only the
    # tail past what the target matched moves; tests/migration/test_protocol.py asserts it page by page)
    assert all(x["bytes"] == x["extra_tokens"] // 4 * page for x in moved), [x["bytes"] for x in lines]
    assert (tmp_path / "migration.parquet").exists()


def test_serve_warns_when_auto_falls_back_to_http(monkeypatch, capsys) -> None:
    from kvmove.server import launch
    from kvmove.transport import NixlTransport

    started: list = []
    monkeypatch.setattr(launch, "serve", lambda config, ready=None, sock=None: started.append(config))
    monkeypatch.setattr(NixlTransport, "is_available", classmethod(lambda cls: False))
    code, _, err = _main(monkeypatch, capsys, "serve", "--enable-kv-migration", "--port", "0")
    assert code == 0 and started[0].transport == "auto"
    note = "NIXL is not installed (pip install 'kvmove[nixl]'); KV pages move over HTTP, a slower fallback"
    assert err.splitlines() == [f"kvmove: warning: {note}"]
    code, _, err = _main(monkeypatch, capsys, "serve", "--enable-kv-migration", "--transport", "nixl")
    assert code == 2 and "--transport http" in err and len(err.splitlines()) == 1
    code, _, err = _main(monkeypatch, capsys, "serve", "--enable-kv-migration", "--transport", "gloo")
    assert code == 2 and "'gloo' is not one of 'auto', 'nixl', 'http'" in err and len(started) == 1


def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys) -> None:
    code, _, err = _main(monkeypatch, capsys, "migrate", "--requests", "50", "--num-pages", "8", "--no-record")
    assert code == 2 and err.startswith("kvmove: error:") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_migrate_over_the_fork_routes_between_workers_of_different_tp(tmp_path) -> None:
    args = ["migrate", "--routes", "sglang", "--tp", "2,1", "--workers", "2", "--requests", "2", "--prompt-len", "16"]
    args += ["--new-tokens", "8", "--num-pages", "32", "--page-size", "4", "--json", "--no-baseline"]
    args += ["--no-measure-link", "--results", str(tmp_path)]
    for _ in range(3):  # NOTE: as above, a run that happened to need no migration is retried
        out = _kvmove(*args)
        lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        if out.returncode == 0 and lines and lines[-1].get("migrations", 0) >= 1:
            break
    assert out.returncode == 0, out.stderr[-3000:]
    summary = lines[-1]
    assert summary["migrations"] >= 1 and summary["verified"] and summary["routes"] == "sglang"
    assert summary["integrity_checked"] is False, "integrity is a kvmove route: not served by these workers"
    assert all(x["routes"] == "sglang" for x in lines[:-1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routes", "grpc"], "'grpc' is not one of 'kvmove', 'sglang'"),
        (["--tp", "2,x"], "--tp takes integers"),
        (["--tp", "1,1,1"], "one per worker"),
        (["--tp", "0"], "one size >= 1"),
    ],
)
def test_bad_routes_and_tp_are_one_line(monkeypatch, capsys, args: list[str], message: str) -> None:
    code, _, err = _main(monkeypatch, capsys, "migrate", *args, "--no-record")
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_serve_tp_and_routes_options_reach_the_config(monkeypatch, capsys) -> None:
    from kvmove.server import launch
    from kvmove.server.config import ServerConfig

    started: list = []
    monkeypatch.setattr(launch, "serve", lambda config, ready=None, sock=None: started.append(config))
    code, _, _ = _main(monkeypatch, capsys, "serve", "--tp", "2", "--no-kvmove-routes", "--port", "0")
    assert code == 0 and (started[0].tp_size, started[0].kvmove_routes) == (2, False)
    args = launch.serve_args(ServerConfig(tp_size=2, kvmove_routes=False))
    assert "--no-kvmove-routes" in args and args[args.index("--tp-size") + 1] == "2"
    assert "--kvmove-routes" not in launch.serve_args(ServerConfig()), "defaults are not repeated"
