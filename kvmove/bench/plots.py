"""PNG plots of the report (matplotlib, Agg backend). A plot whose rows are absent is skipped with a note.

matplotlib is the optional extra ``kvmove[plots]``; without it :func:`render_plots` raises MissingDependencyError.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from kvmove.bench.report import Report
from kvmove.errors import MissingDependencyError

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # pragma: no cover - depends on the environment
    plt = None  # type: ignore[assignment]


class Plots(NamedTuple):
    paths: tuple[Path, ...]
    notes: tuple[str, ...]


def render_plots(report: Report, out_dir: Path) -> Plots:
    """Write every plot whose rows exist under ``out_dir``; never fails for missing rows."""
    if plt is None:
        raise MissingDependencyError("plots need matplotlib: pip install 'kvmove[plots]'")
    out_dir.mkdir(parents=True, exist_ok=True)
    makers: list[tuple[str, Callable[[Report, Path], str | None]]] = [
        ("sync_time.png", _sync_time),
        ("validation.png", _validation),
        ("bandwidth_vs_limit.png", _bandwidth),
        ("phases.png", _phases),
        ("migration_latency.png", _migration_latency),
        ("priority_latency_cdf.png", _priority_cdf),
    ]
    paths, notes = [], []
    for name, make in makers:
        path = out_dir / name
        why = make(report, path)
        plt.close("all")
        if why is None:
            paths.append(path)
        else:
            notes.append(f"{name} skipped: {why}")
    return Plots(tuple(paths), tuple(notes))


def _setup_label(r: pd.Series) -> str:
    tag = f" [{r['constraints']}]" if r.get("constraints") else ""
    return f"{r['kind']}: {r['model']} {r['engine']}{tag}"


def _sync_time(report: Report, path: Path) -> str | None:
    df = report.sync
    if df.empty:
        return "no weight-sync rows"
    setups = list(dict.fromkeys(_setup_label(r) for _, r in df.iterrows()))
    strategies = list(dict.fromkeys(df["strategy"]))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(setups)), 5))
    width = 0.8 / max(1, len(strategies))
    for i, s in enumerate(strategies):
        ys = [_pick(df, label, s, "seconds") for label in setups]
        ax.bar(np.arange(len(setups)) + i * width, ys, width, label=s)
    ax.set_xticks(np.arange(len(setups)) + 0.4 - width / 2, setups, rotation=20, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("sync time (s, log)")
    ax.set_title("Weight sync time per strategy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def _pick(df: pd.DataFrame, label: str, strategy: str, col: str) -> float:
    m = df[[(_setup_label(r) == label and r["strategy"] == strategy) for _, r in df.iterrows()]]
    return float(m[col].iloc[0]) if not m.empty else 0.0


def _validation(report: Report, path: Path) -> str | None:
    df = report.validation
    df = df[df["metric"] == "seconds"] if not df.empty else df
    if df.empty:
        return "no published figures in simulated rows"
    fig, ax = plt.subplots(figsize=(7, 7))
    ax.scatter(df["published"], df["predicted"], color="tab:blue")
    for _, r in df.iterrows():
        ax.annotate(r["figure"], (r["published"], r["predicted"]), fontsize=5, alpha=0.8)
    lo = float(min(df["published"].min(), df["predicted"].min())) / 1.5
    hi = float(max(df["published"].max(), df["predicted"].max())) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="predicted = published")
    ax.fill_between([lo, hi], [lo / 2, hi / 2], [lo * 2, hi * 2], color="gray", alpha=0.15, label="within 2x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("published (s)")
    ax.set_ylabel("simulated (s)")
    ax.set_title("Simulator validation: no figure sets a cost")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def _bandwidth(report: Report, path: Path) -> str | None:
    df = report.sync
    if df.empty or not (df["link_limit_gbps"] > 0).any():
        return "no rows with a link limit"
    df = df[df["link_limit_gbps"] > 0]
    labels = [f"{_setup_label(r)} {r['strategy']}" for _, r in df.iterrows()]
    fig, ax = plt.subplots(figsize=(10, max(4, 0.28 * len(df))))
    y = np.arange(len(df))
    ax.barh(y, df["link_limit_gbps"], color="lightgray", label="link limit (speed of light)")
    ax.barh(y, df["gbps"], color="tab:blue", label="achieved")
    ax.set_yticks(y, labels, fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (log)")
    ax.set_title("Achieved bandwidth vs link limit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def _phases(report: Report, path: Path) -> str | None:
    rows = report.rows
    rows = rows[rows["phases_d"].map(bool) & (rows["strategy"].fillna("") != "")]
    if rows.empty:
        return "no rows with phases"
    rows = rows.drop_duplicates(subset=["kind", "model", "engine", "strategy", "name"], keep="last").tail(24)
    names = sorted({k for d in rows["phases_d"] for k in d})
    fig, ax = plt.subplots(figsize=(10, max(4, 0.3 * len(rows))))
    left = np.zeros(len(rows))
    y = np.arange(len(rows))
    for name in names:
        vals = np.array([float(d.get(name, 0.0)) for d in rows["phases_d"]])
        total = np.array([max(1e-12, sum(float(v) for v in d.values())) for d in rows["phases_d"]])
        ax.barh(y, vals / total, left=left, label=name)
        left += vals / total
    ax.set_yticks(
        y, [f"{r['kind']} {r['model']} {r['strategy']} {r['name'][-20:]}" for _, r in rows.iterrows()], fontsize=6
    )
    ax.set_xlabel("share of summed phase time")
    ax.set_title("Phase breakdown")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def _migration_latency(report: Report, path: Path) -> str | None:
    df = report.migrations
    if df.empty or "prompt_len" not in df.columns:
        return "no migration rows with prompt_len"
    df = df.dropna(subset=["prompt_len"]).sort_values("prompt_len")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(df["prompt_len"], df["seconds"], "o-", label="migration")
    if "reprefill_seconds" in df.columns:
        ax.plot(df["prompt_len"], df["reprefill_seconds"], "s--", label="re-prefill")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("latency (s)")
    ax.set_title("Migration latency vs prompt length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def _priority_cdf(report: Report, path: Path) -> str | None:
    rows = report.rows
    key = "high_priority_latencies"
    rows = rows[rows["extra_d"].map(lambda e: isinstance(e.get(key), list) and bool(e.get(key)))]
    if rows.empty:
        return f"no rows with extra.{key}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for migrate, group in rows.groupby(rows["extra_d"].map(lambda e: bool(e.get("migration")))):
        lat = np.sort(np.concatenate([np.asarray(e[key], dtype=float) for e in group["extra_d"]]))
        ax.step(lat, np.arange(1, len(lat) + 1) / len(lat), where="post", label="with" if migrate else "without")
    ax.set_xlabel("high-priority request latency (s)")
    ax.set_ylabel("CDF")
    ax.set_title("High-priority latency with and without migration")
    ax.legend(title="migration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None
