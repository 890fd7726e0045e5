"""The console script as CI and shells run it: real processes, real exit codes, real file descriptors.

Every ``--json`` stdout here is also fed to ``python -m json.tool --json-lines``, as a script's pipe would be.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

KVMOVE = [sys.executable, "-m", "kvmove.cli.main"]
# A fresh local Ray per run: never the address of a Ray this test session started (Ray exports RAY_ADDRESS).
ENV = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled", "COLUMNS": "120"}
# The smallest real sync: one trainer rank, two single-rank engine replicas of the tiny MoE.
SMALL = ["--trainer", "tp=1", "--engine", "tp=1", "--replicas", "2", "--strategy", "v3"]


def interruptible() -> None:
    """In the child before it execs: SIGINT back to its default, as a terminal's foreground job has it. A test run
    started as a background job of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and a Python whose
    SIGINT is ignored at start installs no KeyboardInterrupt handler: the interrupt tests would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kvmove(*args: str, timeout: float = 300, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or KVMOVE), *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def json_clean(stdout: str) -> list[dict]:
    """Every stdout line is a JSON object, and `python -m json.tool --json-lines` accepts the whole stream."""
    tool = subprocess.run(
        [sys.executable, "-m", "json.tool", "--json-lines"], input=stdout, capture_output=True, text=True
    )
    assert tool.returncode == 0, tool.stderr
    return [json.loads(line) for line in stdout.splitlines()]


def test_usage_error_version_and_help() -> None:
    r = kvmove("sync-weights", "--bogus")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("kvmove: error: No such option")
    assert r.stderr.rstrip().endswith("--bogus (see 'kvmove sync-weights --help')")
    assert kvmove("--version").stdout.startswith("kvmove ")
    assert "Exit codes" in kvmove("-h").stdout


def test_help_imports_no_heavy_library() -> None:
    """`kvmove --help` stays fast: torch, pandas, Ray, matplotlib and FastAPI load only when a command runs."""
    code = "import sys, kvmove.cli.main; print(sorted(m.split('.')[0] for m in sys.modules))"
    loaded = set(
        json.loads(subprocess.check_output([sys.executable, "-c", code], text=True, env=ENV).replace("'", '"'))
    )
    assert not loaded & {"torch", "pandas", "ray", "matplotlib", "fastapi", "numpy", "nixl", "pyarrow"}


# A failing verification, for real: sync 1 is checked against the checkpoint of another seed, so every engine
# rank's actual weights differ bit for bit; both replicas are then killed before sync 2 (no live engine).
WRONG_SEED_FOR_SYNC_1 = """
import dataclasses, sys
from kvmove.sync.driver import step as sync_step
real = sync_step._verify
def verify(ranks, step):
    if step.version != 1:
        return real(ranks, step)
    config = ranks.config
    ranks.config = dataclasses.replace(config, seed=config.seed + 1)
    try:
        return real(ranks, step)
    finally:
        ranks.config = config
sync_step._verify = verify
from kvmove.cli.main import main
sys.argv[0] = "kvmove"
main()
"""


def test_failed_verify_and_no_live_engine_exit_1_naming_them() -> None:
    args = [
        "sync-weights",
        *SMALL,
        "--syncs",
        "2",
        "--verify",
        "--json",
        "--fail-engine",
        "0@2",
        "--fail-engine",
        "1@2",
    ]
    r = kvmove(*args, prefix=[sys.executable, "-c", WRONG_SEED_FOR_SYNC_1])
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == (
        "kvmove: failed: v3 sync 1: engine ranks 0, 1 differ from the loader's weights; "
        "v3 sync 2: no live engine (dead replicas: 0, 1)"
    )
    lines = json_clean(r.stdout)
    assert [(x["verified"], x["mismatched_ranks"], x["live_engines"]) for x in lines] == [
        (False, [0, 1], 2),
        (None, [], 0),
    ]
    assert any(re.match(r"kvmove: \[ *[\d.]+s\] v3: sync 1/2$", line) for line in r.stderr.splitlines())


def test_interrupt_exits_130_after_cleanup() -> None:
    proc = subprocess.Popen(
        [*KVMOVE, "sync-weights", *SMALL, "--syncs", "100"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
        preexec_fn=interruptible,
    )
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # the ranks are starting (Ray is up, actors are being created)
        lines.append(line)
        if "engine ranks" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + err[-3000:]
    assert err.splitlines()[-1] == "kvmove: interrupted" and "Traceback" not in err
    deadline = time.monotonic() + 60
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_alive(proc.pid), "processes of the interrupted run are left behind"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_migrate_json_is_clean_and_records_what_its_plots_need(tmp_path) -> None:
    pytest.importorskip("fastapi")
    args = ["migrate", "--workers", "2", "--requests", "2", "--prompt-len", "16", "--new-tokens", "8"]
    args += ["--num-pages", "32", "--page-size", "4", "--json", "--results", str(tmp_path)]
    for _ in range(2):  # NOTE: on a loaded 2-core machine a worker may miss its 90 s start; that run is retried once
        r = kvmove(*args)
        if not (r.returncode == 2 and "not healthy within" in r.stderr):
            break
    assert r.returncode == 0, r.stderr[-3000:]
    lines = json_clean(r.stdout)
    summary = lines[-1]
    assert summary["kind"] == "summary" and len(summary["high_latencies"]) == 2
    assert len(summary["baseline_high_latencies"]) == 2
    import pandas as pd

    rows = pd.read_parquet(tmp_path / "migration.parquet")
    extras = [json.loads(e) for e in rows["extra"]]
    assert {e["prompt_len"] for e in extras} == {16} and extras[-1]["high_latencies"] == summary["high_latencies"]


def test_serve_ready_line_prometheus_port_in_use_and_interrupt() -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from prometheus_client.parser import text_string_to_metric_families

    proc = subprocess.Popen(
        [*KVMOVE, "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=interruptible,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        url = re.search(r"ready on (http://127\.0\.0\.1:\d+) ", ready)
        assert url, ready + proc.stderr.read() if proc.poll() is not None else ready
        text = httpx.get(f"{url[1]}/metrics", timeout=10)
        assert text.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(text.text)}
        assert {"kvmove_requests_running", "kvmove_kv_pages", "kvmove_tokens", "kvmove_server_info"} <= set(families)
        pages = {s.labels["state"]: s.value for s in families["kvmove_kv_pages"].samples}
        as_json = httpx.get(f"{url[1]}/metrics.json", timeout=10).json()
        assert pages["free"] == as_json["free_pages"] and pages["used"] == as_json["used_pages"]
        assert httpx.get(f"{url[1]}/metrics?format=json", timeout=10).json()["total_pages"] == as_json["total_pages"]
        port = url[1].rsplit(":", 1)[1]
        taken = kvmove("serve", "--port", port, timeout=60)
        assert taken.returncode == 2 and taken.stdout == ""
        assert taken.stderr.splitlines() == [
            f"kvmove: error: cannot listen on 127.0.0.1:{port}: Address already in use (is another server there?)"
        ]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert proc.stderr is not None and proc.stderr.read().splitlines()[-1] == "kvmove: interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_port_in_use_is_refused_before_the_model_is_built() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = kvmove("serve", "--port", str(s.getsockname()[1]), "--model", "no-such-model", timeout=60)
    assert r.returncode == 2 and "cannot listen on" in r.stderr  # not "unknown model": nothing was built


def test_bench_report_json_is_clean() -> None:
    results = Path(__file__).resolve().parents[2] / "results"
    r = kvmove("bench", "report", "--results", str(results), "--format", "json")
    assert r.returncode == 0, r.stderr
    assert {x["table"] for x in json_clean(r.stdout)} >= {"sync", "links", "validation", "costs"}
