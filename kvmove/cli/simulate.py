"""`kvmove bench simulate`: full-scale predictions from costs we measured (flags -> spec -> library -> render)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NamedTuple

import typer

from kvmove.cli import render
from kvmove.cli.options import JsonOpt, OverrideOpt

if TYPE_CHECKING:  # NOTE: imported where used, so `kvmove --help` loads neither pandas nor torch
    from kvmove.bench.results import Row
    from kvmove.bench.sim.costs import CostBook
    from kvmove.bench.sim.setup import Spec
    from kvmove.bench.sim.validation import Validation

ResultsOpt = Annotated[Path, typer.Option("--results", help="Measured rows (costs) and where rows are written.")]


ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset, HF config.json path, or a figure's model.")]
TrainerOpt = Annotated[
    str, typer.Option("--trainer", help="tp=..,pp=..,ep=..[,etp,dp] | fsdp:world=N,shard=S | host:world=N")
]
EngineOpt = Annotated[str, typer.Option("--engine", help="One engine: tp=..,dp=..,ep=..[,pp=..].")]
ReplicasOpt = Annotated[int, typer.Option("--replicas", min=1, help="Engine replicas.")]
TrainerNodesOpt = Annotated[int, typer.Option("--trainer-nodes", min=1, help="Nodes of trainer ranks.")]
EngineNodesOpt = Annotated[int, typer.Option("--engine-nodes", min=1, help="Nodes of engine ranks.")]
ClusterOpt = Annotated[
    str, typer.Option("--cluster", help="gpu=h100|h200|h20|h800|b200,nic=cx7-400|cx7-200|cx8-800[,numbers]")
]
StrategyOpt = Annotated[str, typer.Option("--strategy", help="v1,v2,v3,broadcast,broadcast-pipelined or all.")]
TransportOpt = Annotated[str, typer.Option("--transport", help="pull | push | nccl | cuda-ipc.")]
PlacementOpt = Annotated[str, typer.Option("--placement", help="disaggregated | colocated.")]
FanoutOpt = Annotated[str, typer.Option("--fanout", help="none | chain | tree (relays between replicas).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="bf16 | fp8 (e4m3, block scales).")]
QuantizeOnOpt = Annotated[str, typer.Option("--quantize-on", help="engine | trainer | none (FP8 source).")]
BlockOpt = Annotated[int, typer.Option("--block", min=1, help="FP8 scale block (block x block).")]
DirectOpt = Annotated[bool, typer.Option("--direct/--packed", help="kvmove's direct pulls, or pack all.")]
ViaHostOpt = Annotated[bool, typer.Option("--via-host", help="Stage gathered tensors in host memory.")]
PublishedConstraintsOpt = Annotated[
    bool, typer.Option("--published-constraints", help="Serial PP groups, layer-wise reload, lockstep replicas.")
]
ColdOpt = Annotated[bool, typer.Option("--cold", help="The first sync (registration).")]
GroupSizeOpt = Annotated[int, typer.Option("--group-size", min=1, help="v3: decoder blocks per group.")]
BucketOpt = Annotated[
    int, typer.Option("--bucket-bytes", min=0, help="Broadcast in buckets of this many bytes (0: per tensor).")
]
DeltaOpt = Annotated[
    str,
    typer.Option(
        "--delta-fraction",
        help="Delta sync at a changed fraction: 0.02, per class (attention=0.02,experts=0.03), or 'measured'.",
    ),
]
CostOpt = Annotated[list[str] | None, typer.Option("--cost", help="NAME=VALUE, overrides a cost (repeatable).")]
CostsOpt = Annotated[Path | None, typer.Option("--costs", help="JSON file of cost name -> value.")]
RecordOpt = Annotated[bool, typer.Option("--record", help="Append the rows to RESULTS/simulated.parquet.")]
DoRegenerateOpt = Annotated[
    bool, typer.Option("--regenerate", help="Rewrite RESULTS/simulated.parquet: every simulated row.")
]
DoValidateOpt = Annotated[
    bool,
    typer.Option("--validate", help="Published figures (training/held-out) and our held-out runs vs predictions."),
]
ShowCostsOpt = Annotated[bool, typer.Option("--show-costs", help="Print the cost book and its sources.")]


def simulate(
    model: ModelOpt = ("qwen3-235b-a22b"),
    override: OverrideOpt = None,
    trainer: TrainerOpt = "tp=4,pp=2,ep=8",
    engine: EngineOpt = "dp=16,ep=16",
    replicas: ReplicasOpt = 1,
    trainer_nodes: TrainerNodesOpt = 2,
    engine_nodes: EngineNodesOpt = 2,
    cluster: ClusterOpt = "gpu=h100,nic=cx7-400",
    strategy: StrategyOpt = "all",
    transport: TransportOpt = "pull",
    placement: PlacementOpt = "disaggregated",
    fanout: FanoutOpt = "none",
    dtype: DtypeOpt = "bf16",
    quantize_on: QuantizeOnOpt = "engine",
    block: BlockOpt = 128,
    direct: DirectOpt = False,
    via_host: ViaHostOpt = False,
    published_constraints: PublishedConstraintsOpt = False,
    cold: ColdOpt = False,
    group_size: GroupSizeOpt = 1,
    bucket_bytes: BucketOpt = 0,
    delta_fraction: DeltaOpt = "",
    cost: CostOpt = None,
    costs: CostsOpt = None,
    results: ResultsOpt = Path("results"),
    as_json: JsonOpt = False,
    record: RecordOpt = False,
    do_regenerate: DoRegenerateOpt = False,
    do_validate: DoValidateOpt = False,
    show_costs: ShowCostsOpt = False,
) -> None:
    """Predict weight syncs at full scale with costs from our own measured rows; validate on published figures.

    Example: kvmove bench simulate --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32 --replicas 16
    --trainer-nodes 32 --engine-nodes 64 --fanout tree --direct

    Example: kvmove bench simulate --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32 --replicas 4
    --trainer-nodes 32 --engine-nodes 16 --strategy v3 --delta-fraction measured

    Example: kvmove bench simulate --regenerate    (every simulated row in results/, from the measured rows there)
    """
    from kvmove.bench.sim.costs import load_cost_file, parse_cost_flags
    from kvmove.bench.sim.setup import Spec

    overrides = {**(load_cost_file(costs) if costs else {}), **parse_cost_flags(cost or [])}
    if do_regenerate:
        _regenerate(results, overrides, as_json)
    elif do_validate:
        _validate(results, overrides, show_costs, as_json)
    else:
        spec = Spec(
            model, trainer, engine, replicas, trainer_nodes, engine_nodes, cluster, placement, transport, fanout,
            dtype, quantize_on, block, direct, via_host, "published" if published_constraints else "kvmove",
            group_size, cold=cold, overrides=tuple(override or []), bucket_bytes=bucket_bytes,
            delta=_delta_text(delta_fraction, results),
        )  # fmt: skip
        _predict(spec, strategy, Recording(results, overrides, record), show_costs, as_json)


class Recording(NamedTuple):
    """Where the costs come from (the measured rows under ``results``, then ``overrides``) and whether the
    predicted rows are appended there."""

    results: Path
    overrides: dict[str, float]
    record: bool


def _regenerate(results: Path, overrides: dict[str, float], as_json: bool) -> None:
    """Every simulated row in ``results``, from the measured rows there; the validation it implies."""
    from kvmove.bench.sim.rows import regenerate

    path, rows, book, judged = regenerate(results, overrides)
    _render_validation(judged, as_json)
    if as_json:
        render.json_lines([{"kind": "regenerated", "path": str(path), "rows": len(rows)}])
    else:
        render.line(f"{len(rows)} simulated rows -> {path}; costs without a measurement of ours: {_defaults(book)}")


def _validate(results: Path, overrides: dict[str, float], show_costs: bool, as_json: bool) -> None:
    """Published figures (training/held-out) and our held-out runs against predictions."""
    from kvmove.bench.sim.measure import costs_from_rows
    from kvmove.bench.sim.rows import measured_rows
    from kvmove.bench.sim.tables import costs_frame
    from kvmove.bench.sim.validation import validate_all

    measured = measured_rows(results)
    base = costs_from_rows(measured)
    judged = validate_all(base.with_values(overrides, "set by --cost/--costs") if overrides else base, measured)
    if show_costs and judged.fit is not None:
        render.frame(costs_frame(judged.fit.book), "simulator costs and the rows they come from")
    _render_validation(judged, as_json)


def _predict(spec: Spec, strategy: str, rec: Recording, show_costs: bool, as_json: bool) -> None:
    """One setup's predictions for the chosen strategies: a table (or JSON lines), appended with ``--record``."""
    from kvmove.bench.sim.rows import adhoc_rows, write_rows
    from kvmove.bench.sim.strategies import parse_sim_strategies
    from kvmove.bench.sim.tables import costs_frame, predictions_frame

    spec.build()  # a bad setup is refused before any cost is fitted
    chosen = parse_sim_strategies(strategy)
    book = _book(rec.results, rec.overrides)
    if show_costs:
        render.frame(costs_frame(book), "simulator costs and the rows they come from")
    predictions, rows = adhoc_rows(spec, chosen, book)
    if as_json:
        render.json_lines(_json(r) for r in rows)
    else:
        render.frame(predictions_frame(predictions), f"simulated: {rows[0].extra['setup_detail']}")
        render.line(f"costs without a measurement of ours (named defaults): {_defaults(book)}")
    if rec.record:
        render.line(f"rows appended to {write_rows(rec.results, rows, replace=False)}")


def _delta_text(text: str, results: Path) -> str:
    """``--delta-fraction`` as the setup records it: ``measured`` resolved from the delta rows under ``results``."""
    from kvmove.bench.sim.fractions import measured_fractions, parse_fractions

    if text.strip() != "measured":
        return parse_fractions(text).text() if text.strip() else ""
    from kvmove.bench.sim.rows import measured_rows

    found = measured_fractions(measured_rows(results))
    render.line(f"changed fractions measured at {found.commit[:8]} ({found.rows} rows): {found.fractions.text()}")
    return found.fractions.text()


def _book(results: Path, overrides: dict[str, float]) -> CostBook:
    """Costs from the measured rows under ``results``, the unmeasurable ones fitted on the training figures."""
    from kvmove.bench.sim.fitting import fit
    from kvmove.bench.sim.measure import costs_from_rows
    from kvmove.bench.sim.rows import measured_rows

    book = costs_from_rows(measured_rows(results))
    book = book.with_values(overrides, "set by --cost/--costs") if overrides else book
    return fit(book).book


def _render_validation(judged: Validation, as_json: bool) -> None:
    """The validation table, the fitted values and the summary: a table and lines, or JSON lines."""
    from kvmove.bench.sim.tables import (
        fitted_records,
        split_records,
        splits_line,
        summary_line,
        validation_frame,
        validation_records,
    )
    from kvmove.bench.sim.validation import orders, summary

    if as_json:
        render.json_lines([{"kind": "figure", **r} for r in validation_records(judged)])
        render.json_lines([{"kind": "fitted", **r} for r in fitted_records(judged)])
        render.json_lines([{"kind": "order", "slower": a, "faster": b, "kept": k} for a, b, k in orders(judged.checks)])
        render.json_lines([{"kind": "cpu-split", **r} for r in split_records(judged)])
        render.json_lines([{"kind": "summary", **summary(judged.checks, judged.own)}])
        return
    from collections import Counter

    import pandas as pd

    table = validation_frame(judged)
    shown = ["figure", "role", "strategy", "published", "predicted", "error_pct", "loso_error_pct", "pass_spread_pct",
             "speed_of_light", "binding_link"]  # fmt: skip
    render.frame(table[shown], "published figures and our held-out runs vs predictions (validation; setups in --json)")
    urls = Counter(c.figure.url for c in judged.checks)
    render.line("sources: " + "; ".join(f"{url} ({n})" for url, n in urls.items()))
    render.line("our runs' rows: the source of each in --json")
    render.frame(pd.DataFrame(fitted_records(judged)), "fitted parameters (no measurement of ours can set them)")
    render.line(summary_line(judged))
    render.line(splits_line(judged))


def _defaults(book: CostBook) -> str:
    return ", ".join(book.defaults()) or "none"


def _json(r: Row) -> dict[str, object]:
    extra = r.extra
    return {
        "strategy": r.strategy,
        "seconds": round(r.seconds, 6),
        "bytes_total": r.bytes,
        "gbps": round(r.gbps, 3),
        "speed_of_light_seconds": round(extra["speed_of_light_seconds"], 6),
        "receiver_bound_seconds": round(extra["receiver_bound_seconds"], 6),
        "serial_pp_speed_of_light_seconds": round(extra["serial_pp_speed_of_light_seconds"], 6),
        "sol_ratio": round(extra["sol_ratio"], 4),
        "binding_link": extra["binding_link"],
        "phases": {k: round(v, 6) for k, v in r.phases.items()},
        "constraints": extra["constraints"],
        "setup": extra["setup_detail"],
        "default_costs": [n for n, c in extra["costs"].items() if c["kind"] == "default"],
        "simulated": True,
    }


def simulate_json(spec: Spec, strategies: str, results: Path) -> list[dict[str, object]]:
    """JSON rows of ``sync-weights --simulate`` (costs from the measured rows under ``results``)."""
    from kvmove.bench.sim.rows import adhoc_rows
    from kvmove.bench.sim.strategies import parse_sim_strategies

    _, rows = adhoc_rows(spec, parse_sim_strategies(strategies), _book(results, {}))
    return [_json(r) for r in rows]
