"""How `kvmove bench report` shows its tables: rich tables (readable at 120 columns), markdown, CSV, JSON lines.

Table and markdown show a compact selection of columns with human units; CSV and JSON carry every column of the
library's DataFrames under their machine names (seconds, bytes, GB/s as numbers), one table per CSV.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pandas as pd
from rich.markup import escape
from rich.table import Table

from kvmove.cli import render, streams
from kvmove.models.layout import compact_label

TITLES = {
    "sync": "Weight sync: median seconds per strategy, one row per (commit, setup), fault-free syncs",
    "faults": "Faulty syncs (dead replica, missing ranks, failed verify): kept out of the medians",
    "links": "Raw links: the ceilings syncs are held to",
    "plans": "Full-size sharding plans",
    "validation": "Simulator validation: published figures and our held-out runs vs predictions (training figures set "
    "the fitted costs, held-out ones set none)",
    "migrations": "KV-cache migrations, per prompt length",
    "costs": "Simulator costs (from our measured rows; default = no measurement of ours yet)",
    "other": "Other measured rows (their fields in --format json)",
}


def _layout(r: pd.Series) -> str:
    kind = str(r.get("engine_kind") or "")
    engine = f"{kind} {compact_label(r['engine'])}" if kind and kind != "reference" else compact_label(r["engine"])
    if str(r.get("engine_dtype") or "bf16") != "bf16":
        engine = f"{engine} {r['engine_dtype']}"
    return f"{compact_label(r['trainer'])} → {engine}"


def _transport(r: pd.Series) -> str:
    extra = [str(r.get("pulls") or "")]
    if r.get("constraints"):
        extra.append(f"[{r['constraints']}]")
    return " ".join([str(r["transport"]), *filter(None, extra)])


num = render.num


def _times(v: Any) -> str:
    return "" if pd.isna(v) else f"{v:.1f}x"


def _pct(v: Any) -> str:
    return "" if pd.isna(v) else f"{v:.0f}%"


def _error(v: Any) -> str:
    return "" if v is None or pd.isna(v) else f"{v:+.0f}%"


def _bytes(v: Any) -> str:
    return "" if pd.isna(v) else render.human_bytes(float(v))


def _metric(r: pd.Series, col: str) -> str:
    return _bytes(r[col]) if r["metric"] == "bytes" else num(r[col])


def _range(lo: Any, hi: Any) -> str:
    return "" if pd.isna(lo) else f"{num(lo)}–{num(hi)}"


Column = tuple[str, Callable[[pd.Series], str], bool]  # header, cell, numeric
VIEWS: dict[str, list[Column]] = {
    "sync": [
        ("commit", lambda r: str(r["commit"]), False),
        ("trainer → engine", _layout, False),
        ("transport", _transport, False),
        ("n", lambda r: str(r["syncs"]), True),
        ("v1 s", lambda r: num(r["v1_seconds"]), True),
        ("v2 s", lambda r: num(r["v2_seconds"]), True),
        ("v3 s", lambda r: num(r["v3_seconds"]), True),
        ("bcast\ns", lambda r: num(r["broadcast_seconds"]), True),
        ("v3\nGB/s", lambda r: num(r["v3_gbps"]), True),
        ("v3 %\nceiling", lambda r: _pct(r["v3_pct_of_link"]), True),  # link = the setup's ceiling
        ("v3 vs\nv1", lambda r: _times(r["v3_speedup_vs_v1"]), True),
        ("v3 vs\nbcast", lambda r: _times(r["v3_speedup_vs_broadcast"]), True),
    ],
    "faults": [
        ("commit", lambda r: str(r["commit"]), False),
        ("model", lambda r: str(r["model"]), False),
        ("trainer → engine", _layout, False),
        ("transport", lambda r: str(r["transport"]), False),
        ("strategy", lambda r: str(r["strategy"]), False),
        ("sync", lambda r: num(r["sync"]), True),
        ("seconds", lambda r: num(r["seconds"]), True),
        ("bytes", lambda r: _bytes(r["bytes"]), True),
        ("fault", lambda r: str(r["fault"]), False),
    ],
    "links": [
        ("commit", lambda r: str(r["commit"]), False),
        ("hardware", lambda r: str(r["hardware"]), False),
        ("link", lambda r: str(r["link"]), False),
        ("size", lambda r: _bytes(r["bytes"]), True),
        ("n", lambda r: str(r["runs"]), True),
        ("GB/s", lambda r: num(r["gbps"]), True),
        ("min–max", lambda r: _range(r["gbps_min"], r["gbps_max"]), True),
    ],
    "plans": [
        ("commit", lambda r: str(r["commit"]), False),
        ("model", lambda r: str(r["model"]), False),
        ("trainer → engine", _layout, False),
        ("strategy", lambda r: str(r["strategy"]), False),
        ("plan s", lambda r: num(r["plan_seconds"]), True),
        ("bytes", lambda r: _bytes(r["bytes"]), True),
        ("planner\nmemory", lambda r: _bytes(r["plan_peak_extra_bytes"]), True),
        ("regions", lambda r: num(r["regions_per_replica"]), True),
        ("balance", lambda r: num(r["load_balance"]), True),
    ],
    "validation": [
        ("figure", lambda r: str(r["figure"]), False),
        ("setup", lambda r: str(r["setup"]), False),
        ("strategy", lambda r: str(r["strategy"]), False),
        ("metric", lambda r: str(r["metric"]), False),
        ("published", lambda r: _metric(r, "published"), True),
        ("predicted", lambda r: _metric(r, "predicted"), True),
        ("role", lambda r: str(r["role"]), False),
        ("error", lambda r: _error(r["error_pct"]), True),
        ("leave one\nsource out", lambda r: _error(r["loso_error_pct"]), True),
        ("source", lambda r: str(r["source"]), False),
    ],
    "other": [
        ("commit", lambda r: str(r["commit"]), False),
        ("hardware", lambda r: str(r["hardware"]), False),
        ("suite", lambda r: str(r["suite"]), False),
        ("name", lambda r: str(r["name"]), False),
        ("transport", lambda r: str(r["transport"]), False),
        ("size", lambda r: _bytes(r["bytes"]), True),
        ("seconds", lambda r: num(r["seconds"]), True),
        ("GB/s", lambda r: num(r["gbps"]), True),
    ],
    "migrations": [
        ("commit", lambda r: str(r["commit"]), False),
        ("hardware", lambda r: str(r["hardware"]), False),
        ("transport", lambda r: str(r["transport"]), False),
        ("prompt", lambda r: "" if pd.isna(r["prompt_len"]) else str(int(r["prompt_len"])), True),
        ("n", lambda r: str(r["migrations"]), True),
        ("latency\ns", lambda r: num(r["seconds"]), True),
        ("min–max", lambda r: _range(r["seconds_min"], r["seconds_max"]), True),
        ("KV moved", lambda r: _bytes(r["bytes"]), True),
        ("resume\ns", lambda r: num(r["resume_seconds"]), True),
        ("re-prefill\ns", lambda r: num(r["reprefill_seconds"]), True),
        ("high\np50 s", lambda r: num(r["high_p50_seconds"]), True),
        ("without", lambda r: num(r["baseline_high_p50_seconds"]), True),
    ],
}
GROUPED = {"sync": ("kind", "hardware", "model"), "faults": ("kind", "hardware"), "plans": ("hardware",)}


def _view(name: str, df: pd.DataFrame) -> list[Column]:
    """The columns shown for table ``name`` (every column, formatted, where no view is defined)."""
    if name in VIEWS:
        return VIEWS[name]
    return [(str(c), _cell_of(str(c)), bool(pd.api.types.is_numeric_dtype(df[c]))) for c in df.columns]


def _cell_of(column: str) -> Callable[[pd.Series], str]:
    return lambda r: num(r[column])


def rich_tables(tables: dict[str, pd.DataFrame]) -> None:
    """One rich table per report table (sync: one per kind, hardware and model, named in the title)."""
    con = render.console()
    for name, df in tables.items():
        if df.empty:
            con.print(f"[dim]{TITLES.get(name, name)}: no rows[/dim]")
            continue
        groups = df.groupby(list(GROUPED[name]), sort=False) if name in GROUPED else [((), df)]
        for key, part in groups:
            suffix = " · ".join(map(str, key if isinstance(key, tuple) else (key,)))
            con.print(_rich_table(name, part, TITLES.get(name, name) + (f"\n{suffix}" if suffix else "")))


def _rich_table(name: str, df: pd.DataFrame, title: str) -> Table:
    view = _view(name, df)
    cells = [[escape(cell(r)) for _, cell, _ in view] for _, r in df.iterrows()]  # text, not markup
    return render.fitted_table(title, [h for h, _, _ in view], cells, [n for _, _, n in view])


def markdown(tables: dict[str, pd.DataFrame], notes: list[str]) -> str:
    parts = ["# kvmove benchmark report", ""]
    for name, df in tables.items():
        parts += [f"## {TITLES.get(name, name)}", ""]
        if df.empty:
            parts += ["_no rows_", ""]
            continue
        view = [(h, c, n) for h, c, n in _view(name, df)]
        if name in GROUPED:
            view = [(k, lambda r, k=k: str(r[k]), False) for k in GROUPED[name]] + view
        parts.append("| " + " | ".join(h.replace("\n", " ") for h, _, _ in view) + " |")
        parts.append("|" + "".join("---:|" if n else "---|" for _, _, n in view))
        for _, r in df.iterrows():
            parts.append("| " + " | ".join(c(r).replace("|", "/") for _, c, _ in view) + " |")
        parts.append("")
    if notes:
        parts += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(parts)


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as plain dicts: numbers stay numbers, missing values become None."""
    out = []
    for rec in df.to_dict(orient="records"):
        out.append({str(k): _plain(v) for k, v in rec.items()})
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, dict | list):
        return v
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    return v.item() if hasattr(v, "item") else v


def json_lines(tables: dict[str, pd.DataFrame]) -> None:
    """Every row of every table as one JSON object per line, with ``"table"`` naming its table."""
    render.json_lines({"table": name, **rec} for name, df in tables.items() for rec in records(df))


def csv(name: str, df: pd.DataFrame) -> None:
    """One table as CSV (dict columns as JSON text)."""
    flat = df.copy()
    for c in flat.columns:
        if flat[c].map(lambda v: isinstance(v, dict | list)).any():
            flat[c] = flat[c].map(lambda v: json.dumps(v) if isinstance(v, dict | list) else v)
    streams.out().write(str(flat.to_csv(index=False)))
