"""The report's five PNG plots (matplotlib, Agg backend). A plot whose rows are absent is skipped with a note.

Weight-sync plots draw the latest complete run of every setup (kvmove.bench.runs.latest_complete), faceted by
hardware and model (so a 1 MB CPU toy, a 42 GB GPU slice and an 8.5 TB simulated checkpoint never share an
axis); bars are medians with min-max whiskers; measured bars are solid, simulated ones hatched, published
figures black diamonds, each with its legend entry; every label names transport, pulls and commit and is
wrapped at word boundaries, never cut.

matplotlib is the optional extra ``kvmove[plots]``; without it :func:`render_plots` raises MissingDependencyError.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from kvmove.bench.report import Report
from kvmove.bench.runs import STRATEGY_ORDER, latest_complete
from kvmove.errors import MissingDependencyError
from kvmove.models.layout import compact_label

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
except ImportError:  # pragma: no cover - depends on the environment
    plt = None  # type: ignore[assignment]

COLORS = {"v1": "tab:blue", "v2": "tab:orange", "v3": "tab:green", "broadcast": "tab:red"}
PULLS = ("v1", "v2", "v3")
DPI = 110
PALETTE = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)


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


def wrap(text: str, width: int) -> str:
    """Wrap at spaces (and after commas or arrows when a word is long); never cut inside a word."""
    return textwrap.fill(str(text), width=width, break_long_words=False, break_on_hyphens=False)


def _setup_label(r: pd.Series, width: int = 26) -> str:
    """Layout, transport (+ pulls or simulator constraints) and commit of one setup row."""
    kind = str(r.get("engine_kind") or "")
    engine = f"{kind} {compact_label(r['engine'])}" if kind not in ("", "reference") else compact_label(r["engine"])
    if str(r.get("engine_dtype") or "bf16") != "bf16":
        engine = f"{engine} {r['engine_dtype']}"
    how = " ".join(filter(None, [str(r["transport"]), str(r.get("pulls") or ""), _constraints(r)]))
    return "\n".join(wrap(t, width) for t in (f"{compact_label(r['trainer'])} → {engine}", how, f"@{r['commit']}"))


def _row_label(r: pd.Series, strategy: str, width: int = 56) -> str:
    """Two lines or so: model, strategy and layout; transport, pulls or constraints, and commit."""
    first, how, commit = _setup_label(r, 1000).split("\n")
    return "\n".join([wrap(f"{r['model']} {strategy} · {first}", width), wrap(f"{how} {commit}", width)])


def _constraints(r: pd.Series) -> str:
    c = str(r.get("constraints") or "")
    return f"({c} constraints)" if c else ""


def _facets(df: pd.DataFrame, keys: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per facet, measured before simulated, small data before large."""
    out = []
    for key, g in df.groupby(keys, sort=False):
        values = key if isinstance(key, tuple) else (key,)
        out.append((g["kind"].iloc[0] != "measured", float(g["bytes"].max()), " · ".join(map(str, values)), g))
    out.sort(key=lambda t: (t[0], t[1]))
    return [(title, g) for _, _, title, g in out]


class Grid(NamedTuple):
    fig: Any
    axes: list[Any]  # the figure's ``n`` visible axes, row by row


def _grid(n: int, ncols: int, cell: tuple[float, float]) -> Grid:
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(cell[0] * ncols, cell[1] * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return Grid(fig, flat[:n])


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def _save(fig: Any, path: Path, title: str, legend: list[Any] | None = None) -> None:
    """Title on top, the legend in one row under it (fixed inches, so it never overlaps the axes), then save."""
    height = fig.get_figheight()
    fig.suptitle(title, y=1 - 0.08 / height, va="top", fontsize=11)
    top = 1 - 0.45 / height
    if legend:
        fig.legend(
            handles=legend, loc="upper center", bbox_to_anchor=(0.5, top), ncol=len(legend), fontsize=8, frameon=False
        )
        top -= 0.35 / height
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.15)  # nothing cut at the edges


def _comparisons(report: Report) -> pd.DataFrame:
    """The latest complete run of every setup that compares at least three strategies (single-strategy
    predictions of published setups are drawn against their figures in validation.png)."""
    df = latest_complete(report.sync)
    return df[df["strategies"].str.count(",") >= 2] if not df.empty else df


def _sync_time(report: Report, path: Path) -> str | None:
    df = _comparisons(report)
    if df.empty:
        return "no weight-sync rows"
    facets = _facets(df, ["hardware", "model"])
    fig, axes = _grid(len(facets), 2, (7.5, 4.6))
    for ax, (title, g) in zip(axes, facets, strict=True):
        _sync_facet(ax, g)
        ax.set_title(wrap(f"{title} ({_human(g['bytes'].max())} per sync)", 60), fontsize=9)
    legend: list[Any] = [Patch(color=COLORS[s], label=s) for s in STRATEGY_ORDER]
    legend += [Patch(facecolor="lightgray", label="measured"), Patch(facecolor="white", hatch="///", label="simulated")]
    legend += [Line2D([], [], marker="D", color="black", lw=0, label="published")]
    title = "Weight sync time, latest complete run per setup of three or more strategies (median, whiskers min-max)"
    _save(fig, path, title, legend)
    return None


def _sync_facet(ax: Any, g: pd.DataFrame) -> None:
    width = 0.8 / len(STRATEGY_ORDER)
    for j, (_, r) in enumerate(g.iterrows()):
        hatch = "///" if r["kind"] == "simulated" else None
        for i, s in enumerate(STRATEGY_ORDER):
            y = r[f"{s}_seconds"]
            if pd.isna(y):
                continue
            x = j + (i - 1.5) * width
            err = [[y - r[f"{s}_seconds_min"]], [r[f"{s}_seconds_max"] - y]]
            ax.bar(
                x,
                y,
                width,
                color=COLORS[s],
                hatch=hatch,
                edgecolor="white" if hatch else None,
                yerr=err,
                capsize=2,
                error_kw={"lw": 0.8},
            )
            if r[f"{s}_published"] > 0:
                ax.plot(x, r[f"{s}_published"], marker="D", color="black", ms=5, zorder=5)
    crowded = len(g) >= 5  # narrower labels in smaller type, still wrapped only at spaces
    labels = [_setup_label(r, 22 if crowded else 26) for _, r in g.iterrows()]
    ax.set_xticks(range(len(g)), labels, fontsize=6 if crowded else 7)
    pad = max(0.0, (3 - len(g)) * 0.5)  # few setups: narrower bars, not four bars across a whole panel
    ax.set_xlim(-0.5 - pad, len(g) - 0.5 + pad)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per sync (log)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)


def _validation(report: Report, path: Path) -> str | None:
    df = report.validation
    df = df[df["metric"] == "seconds"] if not df.empty else df
    if df.empty:
        return "no published figures in simulated rows"
    fig, ax = plt.subplots(figsize=(7, 7))
    colors = {"training": "tab:red", "held-out": "tab:blue"}
    for role, group in df.groupby(df["role"].map(lambda r: r if r in colors else "held-out (ours)")):
        label = {"training": "training (sets fitted costs)", "held-out": "held-out published"}.get(role, role)
        ax.scatter(group["published"], group["predicted"], color=colors.get(role, "tab:green"), label=label)
    for _, r in df.iterrows():
        ax.annotate(r["figure"], (r["published"], r["predicted"]), fontsize=5, alpha=0.8)
    lo = float(min(df["published"].min(), df["predicted"].min())) / 1.5
    hi = float(max(df["published"].max(), df["predicted"].max())) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="predicted = published")
    ax.fill_between([lo, hi], [lo / 2, hi / 2], [lo * 2, hi * 2], color="gray", alpha=0.15, label="within 2x")
    ax.set(xscale="log", yscale="log", xlabel="published (s; ours: measured)", ylabel="simulated (s)")
    ax.legend(fontsize=8)
    _save(fig, path, "Simulator validation: published figures and our held-out runs vs predictions")
    return None


def _bandwidth(report: Report, path: Path) -> str | None:
    df = _comparisons(report)
    df = df[df["link_gbps"] > 0] if not df.empty else df
    if df.empty:
        return "no rows with a link limit"
    facets = _facets(df, ["hardware"])
    heights = [sum(r[f"{s}_gbps"] > 0 for _, r in g.iterrows() for s in PULLS) for _, g in facets]
    fig, axes = plt.subplots(
        len(facets),
        1,
        figsize=(10, 1.2 + 0.42 * sum(heights) + 0.8 * len(facets)),
        gridspec_kw={"height_ratios": [max(1, h) for h in heights]},
        squeeze=False,
    )
    for ax, (title, g) in zip(axes[:, 0], facets, strict=True):
        _bandwidth_facet(ax, g)
        ax.set_title(title, fontsize=9, loc="left")
    legend = [Patch(color="lightgray", label="link limit (speed of light)")]
    legend += [Patch(color=COLORS[s], label=f"{s} achieved") for s in PULLS]
    _save(fig, path, "Achieved GB/s vs the link's limit (pull strategies; median, whiskers min-max)", legend)
    return None


def _bandwidth_facet(ax: Any, g: pd.DataFrame) -> None:
    labels, y = [], 0
    for _, r in g.iterrows():
        for s in PULLS:
            value = r[f"{s}_gbps"]
            if not value > 0:
                continue
            err = [[value - r[f"{s}_gbps_min"]], [r[f"{s}_gbps_max"] - value]]
            ax.barh(y, r["link_gbps"], color="lightgray", height=0.8)
            ax.barh(y, value, color=COLORS[s], height=0.5, xerr=err, capsize=2, error_kw={"lw": 0.8})
            ax.text(r["link_gbps"], y, f" {100 * value / r['link_gbps']:.0f}%", va="center", fontsize=7)
            labels.append(_row_label(r, s))
            y += 1
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s", fontsize=8)
    ax.set_xlim(0, g["link_gbps"].max() * 1.15)


def _phases(report: Report, path: Path) -> str | None:
    df = _comparisons(report)
    if df.empty or not any(bool(r[f"{s}_phases"]) for _, r in df.iterrows() for s in STRATEGY_ORDER):
        return "no rows with phases"
    facets = _facets(df, ["hardware"])
    names = sorted({k for _, r in df.iterrows() for s in STRATEGY_ORDER for k in (r[f"{s}_phases"] or {})})
    colors = dict(zip(names, PALETTE, strict=False))
    counts = [sum(bool(r[f"{s}_phases"]) for _, r in g.iterrows() for s in STRATEGY_ORDER) for _, g in facets]
    fig, axes = plt.subplots(
        len(facets),
        1,
        figsize=(11, 1.5 + 0.36 * sum(counts) + 0.8 * len(facets)),
        gridspec_kw={"height_ratios": [max(1, c) for c in counts]},
        squeeze=False,
    )
    for ax, (title, g) in zip(axes[:, 0], facets, strict=True):
        _phases_facet(ax, g, names, colors)
        ax.set_title(title, fontsize=9, loc="left")
    legend = [Patch(color=colors[n], label=n) for n in names]
    _save(fig, path, "Where a sync's time goes: share of summed phase time (phases overlap when pipelined)", legend)
    return None


def _phases_facet(ax: Any, g: pd.DataFrame, names: list[str], colors: dict[str, Any]) -> None:
    labels, y = [], 0
    for _, r in g.iterrows():
        for s in STRATEGY_ORDER:
            phases = r[f"{s}_phases"] or {}
            total = sum(max(0.0, float(v)) for v in phases.values())
            if not phases or total <= 0:
                continue
            left = 0.0
            for n in names:
                share = max(0.0, float(phases.get(n, 0.0))) / total
                ax.barh(y, share, left=left, color=colors[n], height=0.7)
                left += share
            ax.text(1.01, y, f"{r[f'{s}_seconds']:.3g} s", va="center", fontsize=7)
            labels.append(_row_label(r, s))
            y += 1
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12)
    ax.set_xlabel("share of summed phase time (right: sync seconds)", fontsize=8)


def _migration_latency(report: Report, path: Path) -> str | None:
    rows = report.migration_runs
    if rows.empty or "prompt_len" not in rows:
        return "no migration rows"
    moves = rows[(rows["name"] == "migration") & rows["ok"] & rows["prompt_len"].notna()]
    if moves.empty:
        return "no migration rows with prompt_len (kvmove migrate --prompt-len L --results DIR records them)"
    latest = _latest_per_prompt(moves).assign(carried=lambda d: d["bytes"] > 0)
    series = (
        ("seconds", True, "o-", "migration that moved the prompt's KV"),
        ("seconds", False, "^:", "migration to a worker that had the prefix (no KV moved)"),
        ("reprefill_seconds", None, "s--", "re-prefill on the target instead"),
    )
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    for i, ((hardware, transport), g) in enumerate(latest.groupby(["hardware", "transport"], sort=False)):
        where = f"{transport} on {hardware} @{', '.join(sorted(set(g['commit'])))}"
        for col, carried, style, what in series:
            part = g if carried is None else g[g["carried"] == carried]
            stats = part.groupby("prompt_len")[col].agg(["median", "min", "max"]).dropna()
            if stats.empty:
                continue
            err = [stats["median"] - stats["min"], stats["max"] - stats["median"]]
            ax.errorbar(
                stats.index,
                stats["median"],
                yerr=err,
                fmt=style,
                color=PALETTE[i % 10],
                capsize=3,
                label=wrap(f"{what}: {where}", 70),
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("seconds (median, whiskers min-max)")
    ax.legend(fontsize=7)
    _save(fig, path, "KV migration latency vs prompt length (against re-computing the prefix)")
    return None


def _latest_per_prompt(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the latest run (commit) per (hardware, transport, prompt length)."""
    keys = ["hardware", "transport", "prompt_len"]
    newest = df.groupby([*keys, "commit"], sort=False)["timestamp"].max().reset_index()
    newest = newest.sort_values("timestamp").groupby(keys, sort=False).tail(1)
    return df.merge(newest[[*keys, "commit"]], on=[*keys, "commit"])


def _priority_cdf(report: Report, path: Path) -> str | None:
    rows = report.migration_runs
    if rows.empty:
        return "no migration rows"
    summary = rows[(rows["name"] == "summary") & rows["extra_d"].map(lambda e: bool(e.get("high_latencies")))]
    if summary.empty:
        return "no summary rows with high-priority latencies (kvmove migrate --results DIR records them)"
    summary = _latest_per_prompt(summary.assign(prompt_len=summary["prompt_len"].fillna(0)))
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (key, g) in enumerate(summary.groupby(["hardware", "transport", "prompt_len"], sort=False)):
        color = PALETTE[i % 10]
        hardware, transport, prompt = key
        where = f"prompt {int(prompt)}, {transport} on {hardware} @{', '.join(sorted(set(g['commit'])))}"
        for field, style, what in (("high_latencies", "-", "with"), ("baseline_high_latencies", "--", "without")):
            lat = np.sort(np.concatenate([np.asarray(e.get(field) or [], dtype=float) for e in g["extra_d"]]))
            if lat.size:
                cdf = np.arange(1, lat.size + 1) / lat.size
                ax.step(lat, cdf, where="post", ls=style, color=color, label=wrap(f"{what} migration: {where}", 70))
    ax.set_xlabel("high-priority request latency (s)")
    ax.set_ylabel("fraction of requests (CDF)")
    ax.legend(fontsize=7)
    _save(fig, path, "High-priority latency with (solid) and without (dashed) KV migration")
    return None
