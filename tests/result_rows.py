"""Result rows for report and CLI tests: a sync run, a migration sweep, written as of a commit and a time."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvmove.bench.results import Labels, Row, append_rows


def sync_rows(
    seconds: dict[str, float] | None = None, extra: dict[str, object] | None = None, engine: str = "tp=2,ep=2 x2"
) -> list[Row]:
    seconds = seconds or {"v1": 4.0, "v3": 1.0, "broadcast": 8.0}
    return [
        Row(
            kind="measured",
            suite="sync",
            name=f"sync {strategy}",
            model="qwen3-moe-tiny",
            trainer="tp=2,pp=2,ep=2",
            engine=engine,
            strategy=strategy,
            transport="gloo-broadcast" if strategy == "broadcast" else "nixl",
            bytes=10**9,
            seconds=t,
            gbps=1.0 / t,
            phases={"gather": 0.1, "pack": 0.2, "transfer": t / 2, "load": 0.1},
            link_limit_gbps=3.0,
            extra={"direct": True, "live_engines": 4, "dead_replicas": [], "verified": True, **(extra or {})},
        )
        for strategy, t in seconds.items()
    ]


def write(path: Path, suite: str, rows: list[Row], commit: str = "abc", when: str = "") -> None:
    """Append rows as of commit ``commit`` at time ``when`` (ISO; runs are ordered by it)."""
    append_rows(path, suite, rows, Labels("cpu:test x2", {"kvmove": "0"}, commit))
    if when:
        df = pd.read_parquet(path / f"{suite}.parquet")
        df.loc[df.index[-len(rows) :], "timestamp"] = when
        df.to_parquet(path / f"{suite}.parquet", index=False)


def migration_rows() -> list[Row]:
    rows = []
    for n in (64, 256, 1024):
        for i in range(2):
            extra = {"prompt_len": n, "migrations": 1, "verified": True, "reprefill_seconds": n / 5e3}
            rows.append(
                Row(
                    kind="measured",
                    suite="migration",
                    name="migration",
                    transport="nixl",
                    seconds=n / 1e4 + i / 1e3,
                    bytes=n * 1000,
                    extra=extra,
                )
            )
        summary = {"prompt_len": n, "high_latencies": [0.1, 0.2, 0.4], "baseline_high_latencies": [0.5, 0.9, 1.2]}
        rows.append(Row(kind="measured", suite="migration", name="summary", transport="nixl", extra=summary))
    return rows
