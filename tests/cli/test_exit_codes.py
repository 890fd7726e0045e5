"""Exit codes, one-line errors, JSON-only stdout and recording, in process (click's CliRunner isolation around
kvmove's own ``run``, so the exit-code mapping under test is the one the console script uses)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from typer.testing import CliRunner

from kvmove.cli.main import run


class Result(NamedTuple):
    code: int
    out: str
    err: str


def cli(*args: str) -> Result:
    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        code = run(list(args))
        sys.stdout.flush()
        sys.stderr.flush()
        return Result(code, out.getvalue().decode(), err.getvalue().decode())


def fake_result(strategy: str, sync: int, **kw: Any) -> Any:
    from kvmove.sync.driver.result import SyncResult

    base: dict[str, Any] = {
        "strategy": strategy,
        "transport": "nixl",
        "sync": sync,
        "seconds": 0.5,
        "bytes": 1000,
        "gbps": 2e-6,
        "transfer_gbps": 1e-6,
        "verified": True,
        "engine_ranks": 4,
        "trainer_ranks": 4,
        "live_engines": 4,
        "dead_replicas": (),
        "rejoined_replicas": (),
        "phases": {"gather": 0.1, "pack": 0.1, "request": 0.0, "transfer": 0.2, "load": 0.1, "trainer_wait": 0.0},
        "peak_extra_bytes": {"trainer": 0, "engine": 0},
        "bytes_per_engine_rank": (250, 250, 250, 250),
        "bytes_per_trainer_rank": (250, 250, 250, 250),
        "replica_seconds": {0: 0.5, 1: 0.5},
        "notes": (),
    }
    return SyncResult(**{**base, **kw})


class FakeRun(NamedTuple):
    results: list[Any]  # SyncResults to yield, or an exception to raise there
    events: list[str]  # "cleanup" once the run's finally ran


@pytest.fixture
def fake_syncs(monkeypatch) -> FakeRun:
    """Replace the library's run of syncs with canned results; records that its cleanup ran."""
    import kvmove.sync.driver.run as runner

    fake = FakeRun([], [])

    def run_syncs(config: Any, progress: Any = None) -> Iterator[Any]:
        try:
            for r in fake.results:
                if isinstance(r, BaseException):
                    raise r
                progress(f"{r.strategy}: sync {r.sync}")
                yield r
        finally:
            fake.events.append("cleanup")

    monkeypatch.setattr(runner, "run_syncs", run_syncs)
    return fake


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["sync-weights", "--bogus"], "--bogus"),
        (["sync-weights", "--syncs", "0"], "--syncs"),
        (["sync-weights", "--verify", "true"], "unexpected extra argument"),
        (["models", "show"], "Missing argument"),
        (["bench", "report", "--format", "xml"], "--format"),
        (["sync-weights", "--transport", "carrier-pigeon"], "--transport"),
        (["sync-weights", "--strategy", "v1,v9"], "unknown strategy 'v9'"),
        (["sync-weights", "--dry-run", "--fail-engine", "0@1"], "--fail-engine does not apply to --dry-run"),
        (["sync-weights", "--dry-run", "--syncs", "5"], "--syncs does not apply to --dry-run"),
        (["sync-weights", "--dry-run", "--ray-address", "x:1"], "--ray-address does not apply to --dry-run"),
        (["sync-weights", "--simulate", "--verify"], "--verify does not apply to --simulate"),
        (["sync-weights", "--no-reuse"], "--no-reuse does not apply to real syncs"),
        (["sync-weights", "--dry-run", "--simulate"], "--dry-run and --simulate"),
        (["sync-weights", "--dry-run", "--override", "num_expert=64"], "did you mean 'num_experts'"),
        (["migrate", "--transport", "gloo"], "--transport"),
        (["serve", "--port", "70000"], "--port"),
        (["bench", "run", "--suite", "everything"], "--suite"),
        (["bench", "run", "--suite", "gpu"], "needs 1 CUDA GPU(s), 0 visible"),
    ],
)
def test_usage_error_is_one_line_exit_2(args: list[str], says: str) -> None:
    r = cli(*args)
    assert r.code == 2, r
    assert r.err.startswith("kvmove: error:") and says in r.err and len(r.err.splitlines()) == 1, r.err
    assert "Traceback" not in r.err and r.out == ""


def test_version_and_short_help() -> None:
    from kvmove import __version__

    assert cli("--version") == Result(0, f"kvmove {__version__}\n", "")
    for args in (["-h"], ["sync-weights", "-h"], ["bench", "report", "-h"]):
        r = cli(*args)
        assert r.code == 0 and "Usage" in r.out and "Example" in r.out, args


def test_help_groups_options_by_mode_and_shows_choices() -> None:
    out = cli("sync-weights", "--help").out
    for panel in ("Model and layout", "Run: real syncs", "Dry run (--dry-run)", "Simulate (--simulate)"):
        assert panel in out
    for panel in ("Faults (run mode)", "Transport tuning (run mode)", "Output"):
        assert panel in out
    assert "reference|vllm" in out and "[v1|v2|v3|broadcast],..." in out and "cuda-ipc" in out
    assert "table|markdown|csv|json" in cli("bench", "report", "--help").out


def test_failed_verify_exits_1_naming_the_ranks(fake_syncs) -> None:
    fake_syncs.results[:] = [fake_result("v3", 1), fake_result("v3", 2, verified=False, mismatched_ranks=(1, 3))]
    r = cli("sync-weights", "--strategy", "v3", "--syncs", "2", "--verify", "--json")
    assert r.code == 1
    assert r.err.splitlines()[-1] == "kvmove: failed: v3 sync 2: engine ranks 1, 3 differ from the loader's weights"
    lines = [json.loads(line) for line in r.out.splitlines()]
    assert [x["verified"] for x in lines] == [True, False] and lines[1]["mismatched_ranks"] == [1, 3]


def test_no_live_engine_exits_1_and_is_not_a_mismatch(fake_syncs) -> None:
    dead = fake_result("v3", 1, verified=None, live_engines=0, dead_replicas=(0, 1), bytes=0)
    fake_syncs.results[:] = [dead]
    r = cli("sync-weights", "--strategy", "v3", "--verify")
    assert r.code == 1 and "MISMATCH" not in r.out and "no live engine" in r.out
    assert r.err.splitlines()[-1] == "kvmove: failed: v3 sync 1: no live engine (dead replicas: 0, 1)"


def test_all_verified_exits_0_with_progress_lines_on_stderr(fake_syncs) -> None:
    fake_syncs.results[:] = [fake_result("v1", 1), fake_result("v3", 1)]
    r = cli("sync-weights", "--strategy", "v1,v3", "--verify")
    assert r.code == 0 and "bit-exact" in r.out
    assert any(line.endswith("v3: sync 1") for line in r.err.splitlines())  # no TTY: plain lines
    assert all(line.startswith("kvmove: ") for line in r.err.splitlines())


def test_interrupt_exits_130_after_cleanup(fake_syncs) -> None:
    fake_syncs.results[:] = [fake_result("v1", 1), KeyboardInterrupt()]
    r = cli("sync-weights", "--strategy", "v1", "--syncs", "2", "--json")
    assert r.code == 130 and r.err.splitlines()[-1] == "kvmove: interrupted" and fake_syncs.events == ["cleanup"]
    assert [json.loads(line)["sync"] for line in r.out.splitlines()] == [1]


def test_rows_are_recorded_only_with_results(fake_syncs, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    fake_syncs.results[:] = [fake_result("v3", 1)]
    assert cli("sync-weights", "--strategy", "v3").code == 0
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran (make demo leaves the tree clean)
    r = cli("sync-weights", "--strategy", "v3", "--results", "rows", "--json")
    assert r.code == 0 and (tmp_path / "rows" / "sync.parquet").exists()
    assert "1 measured rows appended to rows/sync.parquet" in r.err and len(r.out.splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["sync-weights", "--strategy", "v3"],
        ["migrate", "--requests", "1"],
        ["bench", "run", "--suite", "plan"],
    ],
)
def test_results_from_a_dirty_tree_are_refused_before_anything_runs(fake_syncs, tmp_path, monkeypatch, args) -> None:
    monkeypatch.setenv("KVMOVE_GIT_COMMIT", "0123456789ab-dirty")
    fake_syncs.results[:] = [fake_result("v3", 1)]
    r = cli(*args, "--results", str(tmp_path / "rows"))
    assert r.code == 2 and "refusing to record rows from a dirty tree (0123456789ab-dirty" in r.err, r
    assert len(r.err.splitlines()) == 1 and r.out == "" and fake_syncs.events == []
    assert not (tmp_path / "rows").exists()


def test_dry_run_json_lines_and_a_failed_dry_run_verify_exits_1(monkeypatch) -> None:
    r = cli("sync-weights", "--dry-run", "--verify", "--json", "--strategy", "v1,v3")
    assert r.code == 0 and [json.loads(line)["verified"] for line in r.out.splitlines()] == [True, True]
    import kvmove.sync.driver.dryrun as dryrun

    real = dryrun.dry_run_sync
    monkeypatch.setattr(
        dryrun, "dry_run_sync", lambda c: [x._replace(verified=False, mismatches=("w[0]",)) for x in real(c)]
    )
    r = cli("sync-weights", "--dry-run", "--verify", "--strategy", "v3")
    assert r.code == 1 and "kvmove: failed: dry-run verification failed: v3" in r.err


def test_bench_report_formats(tmp_path) -> None:
    from result_rows import sync_rows, write

    write(tmp_path, "sync", sync_rows())
    r = cli("bench", "report", "--results", str(tmp_path), "--format", "json")
    lines = [json.loads(line) for line in r.out.splitlines()]
    assert r.code == 0 and {x["table"] for x in lines} == {"sync"}
    assert lines[0]["v3_seconds"] == 1.0 and lines[0]["v2_seconds"] is None
    csv = cli("bench", "report", "--results", str(tmp_path), "--format", "csv").out.splitlines()
    assert csv[0].startswith("kind,commit,hardware,model") and len(csv) == 2  # one table, one row
    md = cli("bench", "report", "--results", str(tmp_path), "--format", "markdown", "--table", "sync").out
    assert "| kind | hardware | model | commit |" in md and "## Weight sync" in md and "costs" not in md
    table = cli("bench", "report", "--results", str(tmp_path))
    assert table.code == 0 and "Weight sync" in table.out
    assert max(len(line) for line in table.out.splitlines()) <= 120


def test_committed_results_report_is_json_clean_and_fits_120_columns() -> None:
    results = Path(__file__).resolve().parents[2] / "results"
    r = cli("bench", "report", "--results", str(results), "--format", "json")
    tables = {json.loads(line)["table"] for line in r.out.splitlines()}
    assert r.code == 0 and {"sync", "links", "validation", "costs", "migrations"} <= tables
    text = cli("bench", "report", "--results", str(results)).out
    assert max(len(line) for line in text.splitlines()) <= 120


def test_enums_mirror_the_registries() -> None:
    from kvmove.cli.options import (
        BENCH_TRANSPORT_CHOICES,
        DEFAULT_MODEL,
        SYNC_TRANSPORT_CHOICES,
        EngineKind,
        KVTransport,
    )
    from kvmove.engines import ENGINES
    from kvmove.migration.endpoint import SERVER_TRANSPORTS
    from kvmove.models import DEFAULT_MODEL as MODEL
    from kvmove.transport import KV_TRANSPORTS, TRANSPORTS

    # kvmove.transport owns the transport names (the registry checks its classes against them)
    assert set(SYNC_TRANSPORT_CHOICES) == {"auto"} | (set(TRANSPORTS) - {"http"})
    assert set(BENCH_TRANSPORT_CHOICES) == {"auto"} | set(TRANSPORTS)
    assert {k.value for k in EngineKind} == set(ENGINES)
    assert {t.value for t in KVTransport} == {"auto"} | set(SERVER_TRANSPORTS) == {"auto"} | set(KV_TRANSPORTS)
    assert DEFAULT_MODEL == MODEL


def test_bench_run_prints_rows_and_records_only_with_results(monkeypatch, tmp_path) -> None:
    import kvmove.bench.plans as plans
    from kvmove.bench.results import Row

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plans, "plan_rows", lambda: [Row(kind="measured", suite="plan", name="plan x", seconds=1.5)])
    r = cli("bench", "run", "--suite", "plan", "--json")
    assert r.code == 0 and json.loads(r.out)["name"] == "plan x" and list(tmp_path.iterdir()) == []
    r = cli("bench", "run", "--suite", "plan", "--results", "results")
    assert r.code == 0 and "plan x" in r.out and (tmp_path / "results" / "plan.parquet").exists()


def test_a_reader_that_went_away_is_141_and_quiet(monkeypatch) -> None:
    from kvmove.cli import render

    def closed(rows: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(render, "json_lines", closed)
    assert cli("models", "list", "--json") == Result(141, "", "")


@pytest.mark.parametrize("as_json", [False, True])
def test_a_run_that_fails_part_way_still_prints_the_syncs_that_completed(fake_syncs, as_json: bool) -> None:
    """`--fail-trainer 0@2`: sync 1 completed, then the run ended; its row is on stdout (table or JSON line)."""
    from kvmove.errors import JobFailed

    fake_syncs.results.extend([fake_result("v3", 1), JobFailed("trainer rank 0 killed by a fault at v3 sync 2")])
    r = cli("sync-weights", "--strategy", "v3", *(["--json"] if as_json else []))
    assert r.code == 1 and r.err.splitlines()[-1].startswith("kvmove: failed: trainer rank 0 killed")
    if as_json:
        assert [json.loads(line)["sync"] for line in r.out.splitlines()] == [1]
    else:
        assert "bit-exact" in r.out and "weight syncs over nixl" in r.out
    assert fake_syncs.events == ["cleanup"]
