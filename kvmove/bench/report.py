"""The benchmark report: every row under results/ turned into tables (DataFrames).

Library only: it returns data; the CLI (kvmove.cli.report) renders it as a table, markdown, CSV or JSON lines.
Weight syncs are grouped into runs (kvmove.bench.runs): one row per (commit, setup), faulty syncs apart.
Unreadable or empty files are skipped with a note (the report says which); unknown columns are kept.
Published figures come from the simulated rows that carry them (``extra.published``): the validation table
shows each next to its prediction with the error, good or bad, its role (training: it set a fitted parameter;
held-out) and its leave-one-source-out error; kvmove's own held-out runs appear in the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd

from kvmove.bench import runs
from kvmove.bench.results import COLUMNS, json_dict, read_file
from kvmove.errors import KvmoveError


@dataclass(frozen=True)
class Filters:
    """Which rows a report covers: results-file suites, a hardware substring, a commit prefix, a kind."""

    suites: tuple[str, ...] = ()
    hardware: str = ""
    commit: str = ""
    kind: str = ""

    def apply(self, rows: pd.DataFrame) -> pd.DataFrame:
        keep = pd.Series(True, index=rows.index)
        if self.suites:
            keep &= rows["suite"].isin(self.suites) | rows["source_file"].str.removesuffix(".parquet").isin(self.suites)
        if self.hardware:
            keep &= rows["hardware"].fillna("").str.contains(self.hardware, case=False, regex=False)
        if self.commit:
            keep &= rows["git_commit"].fillna("").str.startswith(self.commit)
        if self.kind:
            keep &= rows["kind"] == self.kind
        return rows[keep]

    def describe(self) -> str:
        given = {"suite": ",".join(self.suites), "hardware": self.hardware, "commit": self.commit, "kind": self.kind}
        return " ".join(f"--{k} {v}" for k, v in given.items() if v)


@dataclass(frozen=True)
class Report:
    """Everything the report shows, as DataFrames (empty ones when a kind of row is absent)."""

    rows: pd.DataFrame
    sync: pd.DataFrame
    validation: pd.DataFrame
    migrations: pd.DataFrame
    costs: pd.DataFrame
    notes: tuple[str, ...] = field(default=())
    faults: pd.DataFrame = field(default_factory=pd.DataFrame)
    links: pd.DataFrame = field(default_factory=pd.DataFrame)
    plans: pd.DataFrame = field(default_factory=pd.DataFrame)
    migration_runs: pd.DataFrame = field(default_factory=pd.DataFrame)
    other: pd.DataFrame = field(default_factory=pd.DataFrame)

    def tables(self) -> dict[str, pd.DataFrame]:
        """The report's tables by name, in the order they are shown."""
        return {
            "sync": self.sync,
            "faults": self.faults,
            "links": self.links,
            "plans": self.plans,
            "validation": self.validation,
            "migrations": self.migrations,
            "costs": self.costs,
            "other": self.other,
        }


class LoadedRows(NamedTuple):
    """Every readable row (decorated), and a note per file skipped or column kept."""

    rows: pd.DataFrame
    notes: list[str]


def load_rows(results_dir: Path) -> LoadedRows:
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
    rows["phases_d"] = rows["phases"].map(json_dict)
    rows["extra_d"] = rows["extra"].map(json_dict)
    return LoadedRows(rows, notes)


def build_report(results_dir: Path, filters: Filters | None = None) -> Report:
    rows, notes = load_rows(results_dir)
    if filters is not None:
        rows = filters.apply(rows)
        if rows.empty:
            raise KvmoveError(f"no rows under {results_dir} match {filters.describe()}")
    return report_from_rows(rows, notes)


def _dirty_notes(rows: pd.DataFrame) -> list[str]:
    """One note per results file holding rows of dirty trees (recorded before recording refused them): they cannot
    be traced to code, and the report keeps them apart from their commit's clean rows."""
    commits = rows["git_commit"].fillna("").astype(str)
    dirty = rows[commits.str.endswith("-dirty")]
    if dirty.empty:
        return []
    files = dirty["source_file"] if "source_file" in dirty.columns else pd.Series("?", index=dirty.index)
    return [
        f"{len(group)} rows of dirty trees ({', '.join(sorted(set(group['git_commit'].astype(str))))}) in {name}: "
        "they cannot be traced to code"
        for name, group in dirty.groupby(files.fillna("?"), sort=True)
    ]


def report_from_rows(rows: pd.DataFrame, notes: list[str] | None = None) -> Report:
    """The report of rows already loaded (and decorated) by :func:`load_rows`."""
    notes = list(notes or [])
    syncs = runs.sync_rows(rows)
    clean = syncs[syncs["fault"] == ""] if not syncs.empty else syncs
    sync = runs.sync_table(runs.series(clean))
    faults = runs.faults_table(syncs)
    if sync.empty:
        notes.append("no weight-sync rows (measured or simulated)")
    if not faults.empty:
        notes.append(f"{len(faults)} faulty syncs (dead replica, missing ranks, failed verify) kept out of the medians")
    migrations = migration_table(rows)
    if migrations.empty:
        notes.append("no migration rows (kvmove migrate --results DIR)")
    notes += _dirty_notes(rows)
    costs = costs_table(rows)
    if not costs.empty and (costs["kind"] == "default").any():
        names = ", ".join(costs.loc[costs["kind"] == "default", "cost"])
        notes.append(f"simulator costs without a measurement of ours yet (named defaults): {names}")
    return Report(
        rows,
        sync,
        validation_table(rows),
        migrations,
        costs,
        tuple(notes),
        faults=faults,
        links=links_table(rows),
        plans=plans_table(rows),
        migration_runs=migration_rows(rows),
        other=other_table(rows),
    )


VALIDATION_COLUMNS = (
    "figure",
    "setup",
    "role",
    "strategy",
    "metric",
    "published",
    "predicted",
    "error_pct",
    "loso_error_pct",
    "pass_spread_pct",
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
            "role": pub.get("role", "held-out"),
            "strategy": r["strategy"],
            "metric": pub.get("metric", "seconds"),
            "published": float(pub["value"]),
            "predicted": float(pub["predicted"]),
            "error_pct": float(pub["error_pct"]),
            "loso_error_pct": pub.get("loso_error_pct"),
            "pass_spread_pct": pub.get("pass_spread_pct"),
            "used_for_costs": "yes" if pub.get("used_for_costs") else "no",
            "source": pub.get("url", "") or pub.get("source", ""),
        }
    return pd.DataFrame(list(recs.values()), columns=list(VALIDATION_COLUMNS))


def migration_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Measured migration and summary rows, decorated: commit, prompt_len, and the fields plots read."""
    df = rows[rows["suite"] == "migration"].copy()
    if df.empty:
        return df
    e = df["extra_d"]
    df["commit"] = df["git_commit"].map(runs.short_commit)
    df["prompt_len"] = pd.to_numeric(e.map(lambda x: x.get("prompt_len")), errors="coerce")
    df["ok"] = e.map(lambda x: bool(x.get("migrations", 1)) and not x.get("error"))
    for key in ("resume_seconds", "reprefill_seconds"):
        df[key] = pd.to_numeric(e.map(lambda x, k=key: x.get(k)), errors="coerce")
    df["hardware"] = df["hardware"].fillna("")
    return df


def migration_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (commit, hardware, model, transport, prompt length): migrations, their latency (median, min,
    max), GB/s, resume vs re-prefill, and high-priority p50 with and without migration."""
    df = migration_rows(rows)
    if df.empty:
        return pd.DataFrame()
    keys = ["commit", "hardware", "model", "transport", "prompt_len"]
    recs = []
    for key, g in df.groupby(keys, sort=False, dropna=False):
        moves = g[(g["name"] == "migration") & g["ok"]]
        summary = g[g["name"] == "summary"]["extra_d"]
        recs.append(
            {
                **dict(zip(keys, key, strict=True)),
                "migrations": len(moves),
                "seconds": moves["seconds"].median(),
                "seconds_min": moves["seconds"].min(),
                "seconds_max": moves["seconds"].max(),
                "bytes": moves["bytes"].sum(),  # what the run moved: later moves find the prefix on the target
                "gbps": moves["gbps"].median(),
                "resume_seconds": moves["resume_seconds"].median(),
                "reprefill_seconds": moves["reprefill_seconds"].median(),
                "high_p50_seconds": _median_of(summary, "high_p50_seconds"),
                "baseline_high_p50_seconds": _median_of(summary, "baseline_high_p50_seconds"),
                "link_gbps": _median_of(summary, "link_gbps"),
                "verified": bool(g["extra_d"].map(lambda x: x.get("verified", True)).all()),
            }
        )
    return pd.DataFrame(recs)


def _median_of(extras: pd.Series, key: str) -> float:
    values = pd.to_numeric(extras.map(lambda x: x.get(key)), errors="coerce")
    return float(values.median()) if values.notna().any() else float("nan")


def links_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Raw link measurements (the ceilings every sync is held to): per (commit, hardware, link, size)."""
    names = rows["name"].fillna("")
    raw = (rows["suite"] == "transport") | names.str.startswith("ceiling") | names.str.startswith("kv migration copy")
    df = rows[raw].copy()
    if df.empty:
        return pd.DataFrame()
    df["commit"] = df["git_commit"].map(runs.short_commit)
    df["hardware"] = df["hardware"].fillna("")
    out = df.groupby(["commit", "hardware", "name", "bytes"], sort=False).agg(
        runs=("gbps", "size"),
        gbps=("gbps", "median"),
        gbps_min=("gbps", "min"),
        gbps_max=("gbps", "max"),
        timestamp=("timestamp", "max"),
    )
    return out.reset_index().rename(columns={"name": "link"})


def other_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Measured rows no other table shows (decode latency, resume vs re-prefill, micro-benchmarks, ...), with their
    ``extra`` fields, so no recorded row is left out of the report."""
    names = rows["name"].fillna("")
    shown = (rows["strategy"].fillna("") != "") | rows["suite"].isin(["transport", "plan", "migration"])
    shown |= names.str.startswith("ceiling") | names.str.startswith("kv migration copy") | (rows["kind"] != "measured")
    df = rows[~shown]
    if df.empty:
        return pd.DataFrame()
    return pd.DataFrame(
        {
            "commit": df["git_commit"].map(runs.short_commit),
            "hardware": df["hardware"].fillna(""),
            "suite": df["suite"],
            "name": df["name"],
            "model": df["model"].fillna(""),
            "transport": df["transport"].fillna(""),
            "bytes": df["bytes"],
            "seconds": df["seconds"],
            "gbps": df["gbps"],
            "extra": df["extra_d"],
        }
    ).reset_index(drop=True)


def plans_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Full-size sharding plans: time to plan and the planner's extra memory, per (commit, setup, strategy)."""
    df = rows[rows["suite"] == "plan"].copy()
    if df.empty:
        return pd.DataFrame()
    e = df["extra_d"]
    return pd.DataFrame(
        {
            "commit": df["git_commit"].map(runs.short_commit),
            "hardware": df["hardware"].fillna(""),
            "model": df["model"],
            "trainer": df["trainer"],
            "engine": df["engine"],
            "strategy": df["strategy"],
            "plan_seconds": df["seconds"],
            "bytes": df["bytes"],
            "plan_peak_extra_bytes": pd.to_numeric(e.map(lambda x: x.get("plan_peak_extra_bytes")), errors="coerce"),
            "regions_per_replica": pd.to_numeric(e.map(lambda x: x.get("regions_per_replica")), errors="coerce"),
            "load_balance": pd.to_numeric(e.map(lambda x: x.get("load_balance")), errors="coerce"),
        }
    ).reset_index(drop=True)


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
