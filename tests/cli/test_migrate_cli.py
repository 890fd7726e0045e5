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

from kvmove.transport import TRANSPORTS


def _kvmove(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmove.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_help_has_examples() -> None:
    for cmd in ("serve", "migrate"):
        out = _kvmove(cmd, "--help", timeout=60)
        assert out.returncode == 0 and "Example:" in out.stdout


@pytest.mark.skipif(not TRANSPORTS["nixl"].is_available(), reason="nixl is not installed")
def test_migrate_json_verifies_and_reports(tmp_path) -> None:
    out = _kvmove(
        "migrate",
        "--workers",
        "2",
        "--requests",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "8",
        "--num-pages",
        "32",
        "--page-size",
        "4",
        "--json",
        "--no-baseline",
        "--no-measure-link",
        "--results",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    summary = lines[-1]
    assert {"migrations", "verified", "bytes", "seconds", "gbps", "integrity_ok"} <= set(summary)
    assert summary["migrations"] == 2 and summary["verified"] and summary["integrity_ok"]
    first, second = lines[0], lines[1]
    assert first["bytes"] == 4 * 512 * 8 and second["bytes"] == 0, "the second move finds the prompt cached"
    assert (tmp_path / "migration.parquet").exists()


def test_bad_input_is_one_line_and_exit_2() -> None:
    out = _kvmove("migrate", "--requests", "50", "--num-pages", "8", "--no-record", timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("kvmove: error:") and len(out.stderr.splitlines()) == 1
