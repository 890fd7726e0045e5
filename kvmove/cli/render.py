"""All output of the commands: rich tables for people, JSON lines for scripts, both on the command's stdout
(:func:`kvmove.cli.streams.out`). Without a terminal, tables are 120 columns wide (``COLUMNS`` overrides)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvmove.cli import streams

if TYPE_CHECKING:
    from kvmove.bench.results import Row
    from kvmove.models.totals import ModelTotals
    from kvmove.sync.driver.dryrun import DryRunReport

WIDTH = 120


def console() -> Console:
    """A console on the command's stdout: the terminal's width, else ``COLUMNS`` or 120."""
    out = streams.out()
    width = None if streams.is_terminal(out) else int(os.environ.get("COLUMNS") or WIDTH)
    return Console(file=out, width=width)


def json_lines(rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line (NaN and infinities as null, so every line parses as strict JSON)."""
    out = streams.out()
    for row in rows:
        print(json.dumps(_finite(row), default=str, allow_nan=False), file=out, flush=True)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def model_list(rows: Sequence[ModelTotals]) -> None:
    table = Table(title="kvmove model presets")
    for col in ("name", "architecture", "layers", "params", "BF16 bytes"):
        table.add_column(col, justify="right" if col in ("layers", "params", "BF16 bytes") else "left")
    for t in rows:
        table.add_row(t.name, t.architecture, str(t.num_layers), f"{t.total_params:,}", human_bytes(t.total_bytes))
    console().print(table)


def model_show(t: ModelTotals) -> None:
    table = Table(title=f"{t.name} ({t.architecture})", show_header=False)
    table.add_column("field")
    table.add_column("value", justify="right")
    table.add_row("tensors", f"{t.num_tensors:,}")
    table.add_row("parameters", f"{t.total_params:,}")
    table.add_row("BF16 bytes", f"{t.total_bytes:,} ({human_bytes(t.total_bytes)})")
    table.add_row("expert parameters", f"{t.expert_params:,}")
    table.add_row("non-expert parameters", f"{t.non_expert_params:,}")
    table.add_row("layers (MoE)", f"{t.num_layers} ({t.moe_layers})")
    families = ", ".join(t.megatron_families) or "none (FSDP2/DTensor sources only)"
    table.add_row("Megatron rules", families)
    table.add_row("tensor table from", "safetensors headers" if t.table_source == "checkpoint" else "config")
    console().print(table)


_TRANSFORM_LABELS = {
    "plain": "as held",
    "trainer": "quantized on the trainer",
    "engine": "BF16 to quantize on the engine",
}


def dry_run(reports: Sequence[DryRunReport]) -> None:
    if not reports:
        return
    r0 = reports[0]
    engine = f"{r0.engine}, {r0.engine_dtype}" if r0.engine_dtype != "bf16" else r0.engine
    table = Table(title=f"sharding plans: {r0.model}, trainer {r0.trainer} -> engine {engine} (dry run)")
    cols = (
        "strategy",
        "plan s",
        "bytes total",
        "max / engine rank",
        "max / trainer rank",
        "balance",
        "regions",
    )
    for col in (*cols, "verified"):
        table.add_column(col, justify="left" if col in ("strategy", "verified") else "right")
    for r in reports:
        verified = {None: "-", True: "[green]bit-exact[/]", False: f"[red]{len(r.mismatches)} mismatches[/]"}
        table.add_row(
            r.strategy,
            f"{r.plan_seconds:.2f}",
            human_bytes(r.bytes_total),
            human_bytes(r.bytes_per_engine_rank_max),
            human_bytes(r.bytes_per_trainer_rank_max),
            f"{r.load_balance:.3f}",
            f"{r.regions:,}",
            verified[r.verified],
        )
    console().print(table)
    console().print(
        f"{r0.engine_ranks} engine ranks, {r0.trainer_ranks} trainer ranks; balance = busiest trainer / mean"
    )
    for r in reports if r0.engine_dtype != "bf16" else ():
        parts = ", ".join(f"{human_bytes(n)} {_TRANSFORM_LABELS.get(k, k)}" for k, n in r.bytes_by_transform.items())
        console().print(f"{r.strategy} on the link: {parts}")
    for r in reports:
        for m in r.mismatches[:10]:
            console().print(f"[red]mismatch[/] ({r.strategy}) {m}")


def bench_rows(rows: Sequence[Row], path: Path | None) -> None:
    where = f"appended to {path}" if path is not None else "not recorded (--results DIR records them)"
    table = Table(title=f"benchmark rows, {where}")
    for col in ("kind", "name", "strategy", "seconds", "bytes", "peak memory", "extra"):
        table.add_column(col, justify="right" if col in ("seconds", "bytes", "peak memory") else "left")
    for r in rows:
        extra = ", ".join(f"{k}={v}" for k, v in r.extra.items())
        table.add_row(
            r.kind,
            r.name,
            r.strategy,
            f"{r.seconds:.2f}",
            human_bytes(r.bytes),
            human_bytes(r.peak_memory_bytes),
            extra,
        )
    console().print(table)


def run_syncs(run: Callable[..., Iterator[Any]], config: Any, *, as_json: bool) -> list[Any]:
    """Drive a run of syncs with progress on stderr; with ``as_json`` print each result as it lands."""
    rows: list[Any] = []
    with streams.progress() as say:
        say(f"{config.model.name}: checking layouts, starting Ray")
        for r in run(config, progress=say):
            rows.append(r)
            say(f"{r.strategy} sync {r.sync}: {r.seconds:.3f} s, {_verified_text(r)}")
            if as_json:
                json_lines([r.as_json()])
    if not as_json:
        sync_table(rows)
    return rows


def _verified_text(r: Any) -> str:
    if r.live_engines == 0:
        return "no live engine"
    return {None: "not verified", True: "bit-exact", False: "MISMATCH"}[r.verified]


def fitted_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool]) -> Table:
    """A table that reads at 120 columns: numbers never wrap, text wraps at spaces, and no column is narrower
    than its longest word (so nothing is cut mid-word). Headers may hold newlines."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, header in enumerate(headers):
        words = [w for row in rows for w in Text.from_markup(row[i]).plain.split()] + header.split()
        table.add_column(
            header,
            justify="right" if numeric[i] else "left",
            no_wrap=numeric[i],
            min_width=min(max((len(w) for w in words), default=1), 24),
            overflow="fold",
        )
    for row in rows:
        table.add_row(*row)
    return table


def sync_table(rows: Sequence[Any]) -> None:
    """One line per sync: time, bytes, phases, peak extra memory, live ranks, verification."""
    if not rows:
        return
    transports = ", ".join(dict.fromkeys(r.transport for r in rows))
    title = (
        f"weight syncs over {transports}: {rows[0].trainer_ranks} trainer ranks -> {rows[0].engine_ranks} engine ranks"
    )
    headers = ["strategy", "sync", "seconds", "bytes", "GB/s", "gather", "pack", "transfer", "load"]
    headers += ["peak extra\ntrainer", "peak extra\nengine", "live\nranks", "verified"]
    table = [_sync_cells(r) for r in rows]
    numeric = [h not in ("strategy", "verified") for h in headers]
    console().print(fitted_table(title, headers, table, numeric))
    for r in rows:
        for note in r.notes:
            console().print(f"[yellow]{r.strategy} sync {r.sync}[/]: {note}")
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.live_engines == r.engine_ranks and r.verified is not False:  # fault-free syncs only
            by.setdefault(r.strategy, []).append(r.seconds)
    means = {s: sum(v) / len(v) for s, v in by.items()}
    if "v1" in means and "v3" in means and means["v3"] > 0:
        console().print(f"v3 vs v1: {means['v1'] / means['v3']:.2f}x faster (mean over syncs, same run)")
    if "broadcast" in means and "v3" in means and means["v3"] > 0:
        console().print(f"v3 vs broadcast: {means['broadcast'] / means['v3']:.2f}x faster")


def _sync_cells(r: Any) -> list[str]:
    verified = {None: "-", True: "[green]bit-exact[/]", False: "[red]MISMATCH[/]"}[r.verified]
    if r.live_engines == 0:
        verified = "[red]no live engine[/]"
    elif r.verified is False:
        verified = f"[red]MISMATCH (ranks {', '.join(map(str, r.mismatched_ranks))})[/]"
    p = r.phases
    return [
        r.strategy,
        str(r.sync),
        f"{r.seconds:.3f}",
        human_bytes(r.bytes),
        f"{r.gbps:.3f}",
        *(f"{p.get(k, 0.0):.3f}" for k in ("gather", "pack", "transfer", "load")),
        human_bytes(r.peak_extra_bytes["trainer"]),
        human_bytes(r.peak_extra_bytes["engine"]),
        f"{r.live_engines}/{r.engine_ranks}",
        verified,
    ]


def num(v: Any) -> str:
    """A number in at most 4 significant digits (thousands separated, integers whole), "" for missing."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or str(v) == "<NA>":
        return ""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if a >= 1 else f"{v:.3g}"


def frame(df: Any, title: str) -> None:
    """Any DataFrame as a table that reads at 120 columns: numbers right-aligned, text (and URLs) on the left."""
    numeric = [str(df[c].dtype).startswith(("float", "int")) for c in df.columns]
    cells = [[escape(num(v)) for v in r] for _, r in df.iterrows()]
    console().print(fitted_table(title, [str(c) for c in df.columns], cells, numeric))


def line(text: str) -> None:
    """One line of a command's output (stdout), unwrapped."""
    console().print(text, highlight=False, soft_wrap=True)


def summary(values: dict[str, float]) -> None:
    for key, value in values.items():
        console().print(f"{key}: {value:.3f}")


SOAK_COLUMNS = ("fds", "rss_bytes", "threads", "host_used_pages", "outbox_used_pages", "device_locked_pages")


def soak_table(rows: Sequence[Row], path: Path | None) -> None:
    """One line per transport and server (by port): what it held after the warm-up -> at the end of the soak."""
    where = f"appended to {path}" if path is not None else "not recorded (--results DIR records them)"
    table = Table(title=f"soak rows, {where} (before -> after, per server)")
    for col in ("transport", "migrations", "p50 s", "port", *SOAK_COLUMNS, "flat"):
        table.add_column(col)
    for r in rows:
        before, after = r.extra["before"], r.extra["after"]
        for i, url in enumerate(before):
            cells = [_change(before[url][k], after[url][k], k == "rss_bytes") for k in SOAK_COLUMNS]
            head = (
                [r.transport, str(r.extra["migrations"]), f"{r.phases['migration_p50_s']:.3f}"] if not i else [""] * 3
            )
            table.add_row(*head, url.rsplit(":", 1)[-1], *cells, str(r.extra["flat"]) if not i else "")
    console().print(table)


def _change(before: int, after: int, as_bytes: bool) -> str:
    show = human_bytes if as_bytes else str
    return f"{show(before)} -> {show(after)}"
