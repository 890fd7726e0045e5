"""`kvmove bench report`: parse, call the library, render."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from kvmove.cli import streams


class Format(StrEnum):
    table = "table"
    markdown = "markdown"
    csv = "csv"
    json = "json"


class TableName(StrEnum):
    sync = "sync"
    faults = "faults"
    links = "links"
    plans = "plans"
    validation = "validation"
    migrations = "migrations"
    costs = "costs"
    other = "other"


class Kind(StrEnum):
    measured = "measured"
    simulated = "simulated"


def report(
    results: Annotated[
        Path, typer.Option("--results", metavar="DIR", help="Directory of result parquet files.")
    ] = Path("results"),
    plots: Annotated[Path | None, typer.Option("--plots", metavar="DIR", help="Write the five PNG plots here.")] = None,
    format: Annotated[Format, typer.Option("--format", help="How to print the tables.")] = Format.table,
    table: Annotated[
        TableName | None, typer.Option("--table", help="Only this table (csv: default sync; one table per file).")
    ] = None,
    suite: Annotated[
        list[str] | None, typer.Option("--suite", help="Only rows of this suite (sync, gpu, vllm, simulated, ...).")
    ] = None,
    hardware: Annotated[str, typer.Option("--hardware", help="Only rows whose hardware contains this text.")] = "",
    commit: Annotated[str, typer.Option("--commit", help="Only rows of commits starting with this.")] = "",
    kind: Annotated[Kind | None, typer.Option("--kind", help="Only measured or only simulated rows.")] = None,
) -> None:
    """Render every measured and simulated row, side by side with the published figures and the links' limits.

    Weight syncs: one row per (commit, setup) from fault-free syncs; faulty ones in their own table.

    Example: kvmove bench report --plots results/plots --format markdown

    Example: kvmove bench report --format json --suite gpu | jq 'select(.table == "sync")'
    """
    from kvmove.bench.report import Filters, build_report
    from kvmove.cli import report_view

    filters = Filters(tuple(suite or ()), hardware, commit, kind.value if kind else "")
    rep = build_report(results, filters)
    notes = list(rep.notes)
    if plots is not None:
        from kvmove.bench.plots import render_plots

        made = render_plots(rep, plots)
        notes += [f"plot written: {p}" for p in made.paths] + list(made.notes)
    tables = rep.tables()
    if format is Format.csv or table is not None:
        name = (table or TableName.sync).value
        tables = {name: tables[name]}
    if format is Format.markdown:
        print(report_view.markdown(tables, notes), file=streams.out())
    elif format is Format.csv:
        report_view.csv(*next(iter(tables.items())))
    elif format is Format.json:
        report_view.json_lines(tables)
    else:
        report_view.rich_tables(tables)
    for n in notes:
        streams.note(f"note: {n}")
