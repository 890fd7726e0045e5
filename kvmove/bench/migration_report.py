"""What ``kvmove migrate`` reports: one JSON-able line per migration and a summary, and their results rows."""

from __future__ import annotations

import statistics
from typing import Any

from kvmove.bench.migration_workload import RunResult
from kvmove.bench.results import Row
from kvmove.migration.endpoint import TransportChoice


def summarize(runs: list[RunResult], link_gbps: float | None, transport: TransportChoice) -> list[dict[str, Any]]:
    """Lines of the migration run (``runs[0]``), then a summary comparing it with the baseline run if any.

    ``link_gbps`` is the raw bandwidth of ``transport`` (the workers' data plane) measured in the same run.
    """
    on = runs[0]
    lines = [_migration_line(on, i) for i in range(len(on.migrations))]
    ok = [mg for mg in on.migrations if mg.ok]
    moved, t = sum(mg.bytes for mg in ok), sum(mg.transport_seconds for mg in ok)
    summary: dict[str, Any] = {
        "kind": "summary",
        "migrations": len(ok),
        "failed": len(on.migrations) - len(ok),
        "finished_before_move": len(on.finished_first),
        "verified": all(all(r.verified.values()) for r in runs),
        "bytes": moved,
        "seconds": sum(mg.seconds for mg in ok),
        "gbps": moved / t / 1e9 if t > 0 else 0.0,
        "integrity_ok": all(r.integrity_ok for r in runs),
        "integrity_checked": all(r.integrity_checked for r in runs),
        "routes": on.migrations[0].routes if on.migrations else "",
        "link_gbps": link_gbps,
        "transport": transport.name,
        "transport_fallback": transport.fallback,
        "resume_seconds_median": _median(on.resume_seconds.values()),
        "reprefill_seconds_median": _median(on.reprefill_seconds.values()),
        "high_p50_seconds": on.p50(),
        "high_p99_seconds": on.latency_quantile(0.99),
        "high_latencies": sorted(on.latency.values()),
    }
    if len(runs) > 1:
        summary["baseline_high_p50_seconds"] = runs[1].p50()
        summary["baseline_high_p99_seconds"] = runs[1].latency_quantile(0.99)
        summary["baseline_high_latencies"] = sorted(runs[1].latency.values())
    return [*lines, summary]


def _migration_line(run: RunResult, i: int) -> dict[str, Any]:
    mg = run.migrations[i]
    return {
        "kind": "migration",
        "rid": mg.rid,
        "source": mg.source,
        "target": mg.target,
        "migration_id": mg.migration_id,
        "migrations": int(mg.ok),
        "verified": bool(run.verified.get(mg.rid)) and mg.ok,
        "bytes": mg.bytes,
        "seconds": mg.seconds,
        "gbps": mg.gbps,
        "integrity_ok": run.integrity_ok,
        "matched_tokens": mg.matched_tokens,
        "extra_tokens": mg.extra_tokens,
        "transport": mg.transport,
        "routes": mg.routes,
        "transport_seconds": mg.transport_seconds,
        "phases": dict(mg.phases),
        "resume_seconds": run.resume_seconds.get(mg.rid),
        "reprefill_seconds": run.reprefill_seconds.get(mg.rid),
        "error": mg.error,
    }


def rows_for(lines: list[dict[str, Any]], model: str, transport: str, prompt_len: int) -> list[Row]:
    """Result rows of the lines; each carries ``prompt_len`` (the x of migration_latency.png), the summary the
    high-priority latencies with and without migration (priority_latency_cdf.png)."""
    return [
        Row(
            kind="measured",
            suite="migration",
            name=line["kind"],
            model=model,
            transport=transport,
            bytes=int(line["bytes"]),
            seconds=float(line["seconds"]),
            gbps=float(line["gbps"]),
            phases={k: float(v) for k, v in line.get("phases", {}).items()},
            link_limit_gbps=float(line.get("link_gbps") or 0.0),
            extra={**{k: v for k, v in line.items() if k != "phases"}, "prompt_len": prompt_len},
        )
        for line in lines
    ]


def _median(values: Any) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None
