"""`kvmove bench`: run benchmark suites into results/ (reports come from `kvmove bench report`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvmove.bench.results import append_rows
from kvmove.cli import render
from kvmove.errors import KvmoveError

app = typer.Typer(no_args_is_help=True, help="Benchmarks: measured and simulated rows in results/.")

ResultsOpt = Annotated[Path, typer.Option("--results", help="Directory of result parquet files.")]

SUITES = ("plan", "quick", "full")


@app.command("run")
def run(
    suite: Annotated[str, typer.Option("--suite", help=f"One of {', '.join(SUITES)}.")] = "quick",
    results: ResultsOpt = Path("results"),
) -> None:
    """Run a benchmark suite and append its rows to results/.

    Example: kvmove bench run --suite plan
    """
    if suite not in SUITES:
        raise KvmoveError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    from kvmove.bench.plans import plan_rows

    rows = plan_rows()
    path = append_rows(results, "plan", rows)
    render.bench_rows(rows, path)
