"""`kvmove bench report` and `kvmove sync-weights --simulate`: parse, call the library, render."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
import typer
from rich.console import Console
from rich.table import Table

from kvmove.bench.report import Report, build_report, to_csv, to_markdown
from kvmove.bench.simulator import KVMOVE, PUBLISHED, Topology, calibrate
from kvmove.bench.simulator import simulate as simulate_setup
from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models.config import ModelConfig

FORMATS = ("table", "markdown", "csv")
console = Console(width=None if sys.stdout.isatty() else 220)


def report(
    results: Annotated[Path, typer.Option("--results", help="Directory of result parquet files.")] = Path("results"),
    plots: Annotated[Path | None, typer.Option("--plots", help="Write PNG plots into this directory.")] = None,
    format: Annotated[str, typer.Option("--format", help="table | markdown | csv.")] = "table",
) -> None:
    """Render every measured and simulated row, side by side with the published figures.

    Example: kvmove bench report --plots results/plots --format markdown
    """
    if format not in FORMATS:
        raise KvmoveError(f"unknown --format {format!r} (known: {', '.join(FORMATS)})")
    rep = build_report(results)
    notes = list(rep.notes)
    if plots is not None:
        from kvmove.bench.plots import render_plots

        made = render_plots(rep, plots)
        notes += [f"plot written: {p}" for p in made.paths] + list(made.notes)
    if format == "markdown":
        print(to_markdown(rep))
    elif format == "csv":
        print(to_csv(rep), end="")
    else:
        _tables(rep)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)


def _tables(rep: Report) -> None:
    titles = {
        "sync": "weight sync per strategy and transport (median over runs)",
        "published": "simulated vs PUBLISHED (published engine's constraints on)",
        "migrations": "KV-cache migrations",
        "calibration": "simulator calibration",
    }
    for key, df in rep.tables().items():
        if df.empty:
            console.print(f"[dim]{titles[key]}: no rows[/dim]")
            continue
        table = Table(title=titles[key])
        for c in df.columns:
            numeric = pd.api.types.is_numeric_dtype(df[c])
            table.add_column(
                str(c),
                overflow="ellipsis",
                no_wrap=True,
                justify="right" if numeric else "left",
                min_width=9 if numeric else None,
                max_width=None if numeric else 18,
            )
        for _, r in df.iterrows():
            table.add_row(*(_cell(v) for v in r))
        console.print(table)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:,.4g}"
    if v is None or v is pd.NA:
        return ""
    return str(v)


def simulate(
    cfg: ModelConfig,
    trainer: TrainerLayout,
    engine: EngineLayout,
    strategies: list[str],
    cluster: str,
    trainer_nodes: int,
    engine_nodes: int,
    published_constraints: bool = False,
    results: Path | None = None,
) -> list[dict[str, Any]]:
    """JSON rows of ``sync-weights --simulate``; costs are calibrated from ``results`` rows when given."""
    topology = Topology.parse(cluster)
    rows_df = None
    if results is not None and results.is_dir() and any(results.glob("*.parquet")):
        from kvmove.bench.report import load_rows

        rows_df, _ = load_rows(results)
    costs = calibrate(rows_df).costs
    constraints = PUBLISHED if published_constraints else KVMOVE
    preds = simulate_setup(cfg, trainer, engine, strategies, topology, trainer_nodes, engine_nodes, constraints, costs)
    return [
        {
            "strategy": p.strategy,
            "seconds": round(p.seconds, 5),
            "bytes_total": p.bytes_total,
            "bytes_kept": p.bytes_kept,
            "gbps": round(p.gbps, 3),
            "speed_of_light_seconds": round(p.speed_of_light_seconds, 5),
            "serial_pp_speed_of_light_seconds": round(p.serial_pp_speed_of_light_seconds, 5),
            "sol_ratio": round(p.sol_ratio, 4),
            "binding_link": p.binding_link,
            "phases": {k: round(v, 5) for k, v in p.phases.items()},
            "constraints": constraints.label,
            "simulated": True,
        }
        for p in preds
    ]
