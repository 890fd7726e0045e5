"""The benchmark report: every row under results/ turned into tables (DataFrames), markdown and CSV.

Library only: it returns data and file paths; the CLI (kvmove.cli.report) renders to the terminal.
Unreadable or empty files are skipped with a note (the report says which); unknown columns are kept.
Published figures come from the simulated rows that carry them (``extra.published``): the validation table
shows each next to its prediction with the error, good or bad, and whether it set any cost (it never does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvmove.bench.results import COLUMNS, read_file
from kvmove.errors import KvmoveError

SYNC_SUITES_EXCLUDED = ("plan", "migration")


@dataclass(frozen=True)
class Report:
    """Everything the report shows, as DataFrames (empty ones when a kind of row is absent)."""

    rows: pd.DataFrame
    sync: pd.DataFrame
    validation: pd.DataFrame
    migrations: pd.DataFrame
    costs: pd.DataFrame
    notes: tuple[str, ...] = field(default=())

    def tables(self) -> dict[str, pd.DataFrame]:
        return {
            "sync": self.sync,
            "validation": self.validation,
            "migrations": self.migrations,
            "costs": self.costs,
        }


def load_rows(results_dir: Path) -> tuple[pd.DataFrame, list[str]]:
    """All readable rows; notes name every file skipped. A KvmoveError if nothing is readable."""
    if not results_dir.is_dir():
        raise KvmoveError(f"results directory {results_dir} does not exist; run `kvmove bench run` first")
    files = sorted(results_dir.glob("*.parquet"))
    if not files:
        raise KvmoveError(f"no results (*.parquet) under {results_dir}; run `kvmove bench run` first")
    frames, notes = [], []
    for f in files:
        try:
            df = read_file(f)
        except KvmoveError as exc:
            notes.append(f"skipped: {exc}")
            continue
        if df.empty:
            notes.append(f"skipped: results file {f} has no rows")
            continue
        unknown = sorted(set(df.columns) - set(COLUMNS))
        if unknown:
            notes.append(f"{f.name}: kept unknown column(s) {', '.join(unknown)} (written by a newer kvmove?)")
        frames.append(df.assign(source_file=f.name))
    if not frames:
        raise KvmoveError(f"no readable rows under {results_dir} ({'; '.join(notes)})")
    rows = pd.concat(frames, ignore_index=True)
    for c in COLUMNS:
        if c not in rows.columns:
            rows[c] = pd.NA
    for c in ("bytes", "seconds", "gbps", "link_limit_gbps"):
        rows[c] = pd.to_numeric(rows[c], errors="coerce").fillna(0.0)
    rows["phases_d"] = rows["phases"].map(_json_dict)
    rows["extra_d"] = rows["extra"].map(_json_dict)
    return rows, notes


def _json_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value) if isinstance(value, str) else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def build_report(results_dir: Path) -> Report:
    rows, notes = load_rows(results_dir)
    return report_from_rows(rows, notes)


def report_from_rows(rows: pd.DataFrame, notes: list[str] | None = None) -> Report:
    """The report of rows already loaded (and decorated) by :func:`load_rows`."""
    notes = list(notes or [])
    sync = sync_table(rows)
    if sync.empty:
        notes.append("no weight-sync rows (measured or simulated)")
    migrations = migration_table(rows)
    if migrations.empty:
        notes.append("no migration rows (results/migration.parquet)")
    validation = validation_table(rows)
    costs = costs_table(rows)
    if not costs.empty and (costs["kind"] == "default").any():
        names = ", ".join(costs.loc[costs["kind"] == "default", "cost"])
        notes.append(f"simulator costs without a measurement of ours yet (named defaults): {names}")
    return Report(rows, sync, validation, migrations, costs, tuple(notes))


def sync_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (kind, setup, constraints, strategy, transport): median time, GB/s, % of link limit, speedups."""
    df = rows[(rows["strategy"].fillna("") != "") & ~rows["suite"].isin(SYNC_SUITES_EXCLUDED)].copy()
    if df.empty:
        return pd.DataFrame()
    df["constraints"] = df["extra_d"].map(lambda e: e.get("constraints", ""))
    df["hardware"] = df["hardware"].fillna("")
    df["pulls"] = [_pulls(k, s, e) for k, s, e in zip(df["kind"], df["strategy"], df["extra_d"], strict=True)]
    # NOTE: measured rows are grouped per commit, so speedups compare syncs of one run, never across code versions
    commits = zip(df["kind"], df["git_commit"].fillna(""), strict=True)
    df["commit"] = [str(c)[:8] if k == "measured" else "" for k, c in commits]
    df["engine_kind"] = df["extra_d"].map(lambda e: e.get("engine_kind", ""))
    keys = ["kind", "model", "trainer", "engine", "engine_kind", "constraints", "hardware", "commit"]
    keys += ["strategy", "pulls", "transport"]
    for k in keys:
        df[k] = df[k].fillna("").astype(str)
    out = df.groupby(keys, sort=False).agg(
        runs=("seconds", "size"),
        seconds=("seconds", "median"),
        bytes=("bytes", "median"),
        gbps=("gbps", "median"),
        link_limit_gbps=("link_limit_gbps", "median"),
    )
    out = out.reset_index()
    out["pct_of_link_limit"] = (100 * out["gbps"] / out["link_limit_gbps"]).where(out["link_limit_gbps"] > 0)
    setup = ["kind", "model", "trainer", "engine", "engine_kind", "constraints", "hardware", "commit"]
    for base in ("v1", "broadcast"):
        ref = out[out["strategy"] == base].groupby(setup)["seconds"].min().rename(f"ref_{base}")
        out = out.join(ref, on=setup)
        out[f"speedup_vs_{base}"] = out[f"ref_{base}"] / out["seconds"]
        out = out.drop(columns=f"ref_{base}")
    return out


def _pulls(kind: str, strategy: str, extra: dict[str, Any]) -> str:
    """How a measured v2/v3 sync moved its regions: "direct" (from trainer arenas where possible) or "packed"
    (every region packed; rows written before direct pulls existed carry no flag and were packed)."""
    if kind != "measured" or strategy not in ("v2", "v3"):
        return ""
    return "direct" if extra.get("direct") else "packed"


VALIDATION_COLUMNS = (
    "figure",
    "setup",
    "strategy",
    "metric",
    "published",
    "predicted",
    "error_pct",
    "used_for_costs",
    "source",
)


def validation_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Every published figure (newest simulated row carrying it): value, source URL, prediction, error, and
    whether it set any simulator cost."""
    sim = rows[(rows["kind"] == "simulated") & rows["extra_d"].map(lambda e: bool(e.get("published")))]
    recs: dict[str, dict[str, Any]] = {}
    for _, r in sim.iterrows():
        pub = r["extra_d"]["published"]
        if "figure" not in pub:  # rows of an older simulator carry no figure key
            continue
        recs[pub["figure"]] = {
            "figure": pub["figure"],
            "setup": pub.get("what", ""),
            "strategy": r["strategy"],
            "metric": pub.get("metric", "seconds"),
            "published": float(pub["value"]),
            "predicted": float(pub["predicted"]),
            "error_pct": float(pub["error_pct"]),
            "used_for_costs": "yes" if pub.get("used_for_costs") else "no",
            "source": pub.get("url", ""),
        }
    return pd.DataFrame(list(recs.values()), columns=list(VALIDATION_COLUMNS))


def migration_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Migration rows: latency split (phases), GB/s, and resume vs re-prefill where the row records them."""
    df = rows[rows["suite"] == "migration"]
    if df.empty:
        return pd.DataFrame()
    recs = []
    for _, r in df.iterrows():
        e = r["extra_d"]
        rec = {"kind": r["kind"], "name": r["name"], "seconds": r["seconds"], "bytes": r["bytes"], "gbps": r["gbps"]}
        rec.update({f"phase_{k}": v for k, v in r["phases_d"].items()})
        for key in ("prompt_len", "resume_seconds", "reprefill_seconds", "verified"):
            if key in e:
                rec[key] = e[key]
        if "resume_seconds" in e and "reprefill_seconds" in e and e["resume_seconds"]:
            rec["resume_speedup"] = e["reprefill_seconds"] / e["resume_seconds"]
        recs.append(rec)
    return pd.DataFrame(recs)


def costs_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The simulator's costs as the newest simulated row records them: value, kind (measured, derived, fitted,
    default = no measurement of ours yet, user) and the commits of the rows each came from."""
    sim = rows[(rows["kind"] == "simulated") & rows["extra_d"].map(lambda e: isinstance(e.get("costs"), dict))]
    if sim.empty:
        return pd.DataFrame()
    costs = sim.iloc[-1]["extra_d"]["costs"]
    recs = []
    for name, c in costs.items():
        if not isinstance(c, dict):  # rows of an older simulator
            return pd.DataFrame()
        recs.append(
            {"cost": name, "value": c.get("value"), "kind": c.get("kind"), "commits": ", ".join(c.get("commits", []))}
        )
    return pd.DataFrame(recs)


def to_markdown(report: Report) -> str:
    parts = ["# kvmove benchmark report", ""]
    titles = {
        "sync": "Weight sync (per strategy and transport)",
        "validation": "Simulator validation: published figures vs predictions (no figure sets a cost)",
        "migrations": "KV-cache migrations",
        "costs": "Simulator costs (from our measured rows; default = no measurement of ours yet)",
    }
    for key, df in report.tables().items():
        parts += [f"## {titles[key]}", ""]
        parts += [_markdown(df) if not df.empty else "_no rows_", ""]
    if report.notes:
        parts += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(parts)


def _markdown(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_cell(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "" if pd.isna(v) else f"{v:.4g}"
    return str(v).replace("|", "/")


def to_csv(report: Report) -> str:
    """All tables stacked, with a ``table`` column naming each."""
    frames = [df.assign(table=name) for name, df in report.tables().items() if not df.empty]
    if not frames:
        return ""
    out = pd.concat(frames, ignore_index=True)
    return str(out[["table", *[c for c in out.columns if c != "table"]]].to_csv(index=False))
