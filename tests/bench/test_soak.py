"""The soak suite on a short run: 50 migrated requests per KV transport between two `kvmove serve` processes, with
clients abandoning long requests and stalling halfway through their bodies, and nothing the servers hold (fds, OS
threads, resident memory, pages, locks, pending migrations, grants) grows; the CLI path writes its rows."""

from __future__ import annotations

import sys

import pandas as pd
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from kvmove.bench.soak import SoakConfig, run_soak, soak_rows
from kvmove.server.messages import Resources


def test_fifty_migrations_leave_nothing_behind(transport: str) -> None:
    cfg = SoakConfig(migrations=50, warmup=5)
    result = run_soak(cfg, transport)
    assert len(result.migrations) == 50 and all(mg.ok and mg.bytes > 0 for mg in result.migrations)
    assert result.verified == 5 and not result.wrong
    assert result.problems(cfg) == [], result.growth()
    rude = result.rude  # every 10th step: a client gave up on a long request, another stalled halfway
    assert rude.abandoned == rude.stalled == rude.closed_by_server == 6
    (row,) = soak_rows(cfg, [result])
    assert row.kind == "measured" and row.extra["flat"] is True and row.transport == transport
    assert row.extra["abandoned_requests"] == row.extra["stalled_closed_by_server"] == 6
    for r in (*result.before.values(), *result.after.values()):
        assert r.threads > 3, "OS threads (/proc/self/task), not Python's"


def _resources(**changes: int) -> Resources:
    base = dict.fromkeys(Resources.model_fields, 0) | {"fds": 40, "rss_bytes": 300 << 20, "threads": 9}
    return Resources(**(base | changes))


@pytest.mark.parametrize(("after", "code"), [({}, 0), ({"fds": 140}, 1), ({"host_used_pages": 3}, 1)])
def test_the_soak_suite_writes_rows_and_fails_when_something_grew(monkeypatch, capsys, tmp_path, after, code) -> None:
    """The CLI glue (the servers themselves are soaked above): rows written, a table, exit 1 naming the growth."""
    from kvmove.bench import soak
    from kvmove.cli.main import main

    def fake(cfg: SoakConfig, transport: str) -> soak.SoakResult:
        assert cfg.migrations == 30 and cfg.warmup == 3
        url = "http://127.0.0.1:1"
        return soak.SoakResult(transport, {url: _resources()}, {url: _resources(**after)}, wall_seconds=1.0)

    monkeypatch.setattr(soak, "run_soak", fake)
    args = ["bench", "run", "--suite", "soak", "--transport", "http", "--migrations", "30", "--results", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["kvmove", *args])
    got = 0
    try:
        main()
    except SystemExit as exc:
        got = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert got == code and "appended to" in out
    if code:
        assert "soak not flat" in err and "grew by" in err
    rows = pd.read_parquet(tmp_path / "soak.parquet")
    assert list(rows["suite"]) == ["soak"] and list(rows["transport"]) == ["http"]
