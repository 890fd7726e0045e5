"""`kvmove bench report`: parse, call the library, render."""

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
from kvmove.errors import KvmoveError

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
        "validation": "simulator validation: published figures vs predictions (no figure sets a cost)",
        "migrations": "KV-cache migrations",
        "costs": "simulator costs (default = no measurement of ours yet)",
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
