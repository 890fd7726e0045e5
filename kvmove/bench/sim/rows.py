"""Simulated rows for ``results/``: the validation setups and the setups users run, from one command.

``regenerate(results_dir)`` derives the cost book from the measured rows under ``results_dir`` and rewrites
``results_dir/simulated.parquet`` with every simulated row (nothing else writes simulated rows there), so after
new measured rows land, ``kvmove bench simulate --regenerate`` brings every prediction up to date.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from kvmove.bench.results import COLUMNS, Labels, Row, git_commit, read_file, to_record, versions
from kvmove.bench.sim.costs import CostBook
from kvmove.bench.sim.fractions import measured_fractions
from kvmove.bench.sim.hardware import Cluster
from kvmove.bench.sim.measure import costs_from_rows
from kvmove.bench.sim.models import sim_model
from kvmove.bench.sim.ownruns import OwnCheck
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.pricing import Prediction
from kvmove.bench.sim.setup import SimSetup, Spec, TrainerSpec
from kvmove.bench.sim.strategies import SIM_STRATEGIES, SimStrategy, parse_sim_strategies
from kvmove.bench.sim.validation import Check, Validation, figure_setup, validate, validate_all
from kvmove.errors import KvmoveError
from kvmove.models.layout import EngineLayout

SUITE = "simulated"


def prediction_row(p: Prediction, s: SimSetup, book: CostBook, label: str, check: Check | None = None) -> Row:
    """One ``Row(kind="simulated")``: the prediction, its setup, its bounds and the costs it used."""
    extra: dict[str, Any] = {
        "setup": label,
        "setup_detail": s.label(),
        "cluster": s.cluster.spec(),
        "trainer_nodes": s.trainer_nodes,
        "engine_nodes": s.engine_nodes,
        "placement": s.placement,
        "fanout": s.fanout,
        "dtype": s.dtype,
        "quantize_on": s.quantize_on,
        "constraints": s.constraints.label,
        "speed_of_light_seconds": p.speed_of_light_seconds,
        "receiver_bound_seconds": p.receiver_bound_seconds,
        "serial_pp_speed_of_light_seconds": p.serial_pp_speed_of_light_seconds,
        "binding_link": p.binding_link,
        "sol_ratio": p.sol_ratio,
        "bytes_kept": p.bytes_kept,
        "delta": s.delta.text() if s.delta is not None else None,
        "bucket_bytes": s.bucket_bytes,
        "costs": {n: {"value": c.value, "kind": c.kind, "commits": c.commits()} for n, c in book.costs.items()},
    }
    if check is not None:
        f = check.figure
        extra["published"] = {
            "figure": f.key,
            "what": f.what,
            "source": f.source,
            "url": f.url,
            "metric": f.metric,
            "value": f.value,
            "predicted": check.predicted,
            "error_pct": check.error_pct,
            "used_for_costs": check.used_for_costs,
            "role": check.role,
            "loso_predicted": check.loso,
            "loso_error_pct": check.loso_error_pct,
            "assumptions": f.assumptions,
        }
    return Row(
        kind="simulated",
        suite=SUITE,
        name=f"simulate {label} {p.strategy}",
        model=s.model.name,
        trainer=s.trainer.label(),
        engine=s.engine.label(),
        strategy=p.strategy,
        transport=s.transport,
        bytes=int(p.bytes_moved),
        seconds=p.seconds,
        gbps=p.gbps,
        phases=p.phases,
        link_limit_gbps=p.bytes_moved / p.speed_of_light_seconds / 1e9 if p.speed_of_light_seconds > 0 else 0.0,
        extra=extra,
    )


def user_setups() -> Iterator[tuple[str, SimSetup]]:
    """The setups users run, beyond the published ones: kvmove's own engine on the published layouts, Kimi K2
    with 16 replicas and every fan-out, FP8 quantized on either side, host-memory and FSDP trainers,
    colocated placement, and each GPU preset."""
    qwen, kimi = sim_model("qwen3-235b-a22b"), sim_model("kimi-k2")
    base_q = SimSetup(qwen, TrainerSpec.parse("tp=4,pp=2,ep=8"), EngineLayout.parse("dp=16,ep=16"), Cluster(), 2, 2)
    base_k = SimSetup(
        kimi, TrainerSpec.parse("tp=8,pp=8,ep=32"), EngineLayout.parse("tp=32,ep=32", 4), Cluster(), 32, 16
    )
    yield "qwen3-235b kvmove", dataclasses.replace(base_q, direct=True)
    yield "kimi-k2 kvmove", dataclasses.replace(base_k, direct=True)
    wide = dataclasses.replace(base_k, engine=EngineLayout.parse("tp=32,ep=32", 16), engine_nodes=64, direct=True)
    for fanout in ("none", "chain", "tree"):
        yield f"kimi-k2 16 replicas fan-out {fanout}", dataclasses.replace(wide, fanout=fanout)
    fp8 = EngineLayout.parse("tp=16,ep=16", 8)  # the same 128 GPUs; TP32 cuts FP8 blocks, which vLLM refuses
    for side in ("trainer", "engine"):
        yield f"kimi-k2 fp8 quantized on {side}", dataclasses.replace(base_k, engine=fp8, dtype="fp8", quantize_on=side)
    fsdp = TrainerSpec.parse("fsdp:world=256,shard=8")
    yield "kimi-k2 fsdp trainer", dataclasses.replace(base_k, trainer=fsdp)
    yield "kimi-k2 push", dataclasses.replace(base_k, transport="push", direct=True)
    host = TrainerSpec.parse("host:world=16")
    yield (
        "qwen3-235b host memory, colocated",
        dataclasses.replace(base_q, trainer=host, placement="colocated", trainer_nodes=2, engine_nodes=2),
    )
    coloc = SimSetup(qwen, TrainerSpec.parse("tp=4,pp=2,ep=8"), EngineLayout.parse("tp=8", 2), Cluster(), 2, 2)
    yield "qwen3-235b colocated cuda-ipc", dataclasses.replace(coloc, placement="colocated", transport="cuda-ipc")
    for gpu in ("h100", "h200", "h20", "b200"):
        cluster = Cluster.parse(f"gpu={gpu},nic={'cx8-800' if gpu == 'b200' else 'cx7-400'}")
        yield f"kimi-k2 on {gpu}", dataclasses.replace(base_k, cluster=cluster, direct=True)


DELTA_SWEEP = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Changed fractions the Kimi K2 delta rows sweep, beside the measured ones."""


def delta_setups(rows: pd.DataFrame | None) -> Iterator[tuple[str, SimSetup]]:
    """Kimi K2 over 400 Gb/s NICs (the vLLM post's 48 nodes, kvmove's engine, packed v3): dense, a delta sync at
    the changed fractions the delta suite measured (when there are delta rows), and a sweep of fractions (dense
    with direct reads is the user setup "kimi-k2 kvmove")."""
    kimi = Spec("kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32", 4, 32, 16, "gpu=h100,nic=cx7-400,nics_per_node=8")
    yield "kimi-k2 400G dense", kimi.build()
    try:
        found = measured_fractions(rows)
        yield f"kimi-k2 400G delta measured {found.commit[:8]}", replace(kimi, delta=found.fractions.text()).build()
    except KvmoveError:
        pass
    for f in DELTA_SWEEP:
        yield f"kimi-k2 400G delta {f:g}", replace(kimi, delta=f"{f:g}").build()


def own_row(o: OwnCheck, book: CostBook) -> Row:
    """A held-out measured run of ours and its prediction, as a simulated row carrying ``extra.published``."""
    s = o.run.spec.build()
    (p,) = simulate(s, [SIM_STRATEGIES[o.run.strategy]], book)
    row = prediction_row(p, s, book, o.run.key)
    row.extra["published"] = {
        "figure": o.run.key,
        "what": o.run.what,
        "source": "kvmove measured rows (held out)",
        "url": "",
        "metric": "seconds",
        "value": o.run.measured,
        "predicted": o.predicted,
        "error_pct": o.error_pct,
        "used_for_costs": False,
        "role": o.run.role,
        "loso_predicted": None,
        "loso_error_pct": None,
        "pass_spread_pct": o.run.pass_spread_pct,
        "rows": [r.label() for r in o.run.rows],
        "assumptions": o.run.basis,
    }
    return row


def simulated_rows(book: CostBook, judged: Validation | None = None, measured: pd.DataFrame | None = None) -> list[Row]:
    """Every figure's setup (with its figure), our own held-out runs, every user setup with every strategy, and
    the Kimi K2 delta rows (v3)."""
    checks = judged.checks if judged else validate(book)
    rows = [prediction_row(c.prediction, figure_setup(c.figure), book, c.figure.key, c) for c in checks]
    if judged and judged.own:
        rows += [own_row(o, o.book or judged.own_books[o.run.target]) for o in judged.own]
    for label, s in user_setups():
        for p in simulate(s, SIM_STRATEGIES.values(), book):
            rows.append(prediction_row(p, s, book, label))
    for label, s in delta_setups(measured):
        (p,) = simulate(s, [SIM_STRATEGIES["v3"]], book)
        rows.append(prediction_row(p, s, book, label))
    return rows


def measured_rows(results_dir: Path) -> pd.DataFrame | None:
    """Every measured row under ``results_dir`` (simulated rows are outputs, never inputs)."""
    frames = []
    for path in sorted(results_dir.glob("*.parquet")) if results_dir.is_dir() else []:
        df = read_file(path)
        frames.append(df[df["kind"] == "measured"] if "kind" in df.columns else df.iloc[0:0])
    if not frames:
        return None
    out = pd.concat(frames, ignore_index=True)
    for c in COLUMNS:
        if c not in out.columns:
            out[c] = pd.NA
    return out


def adhoc_rows(spec: Spec, strategies: list[SimStrategy], book: CostBook) -> tuple[list[Prediction], list[Row]]:
    """Predictions of one setup from flags, and their rows (which carry the flags, so they regenerate)."""
    s = spec.build()
    predictions = simulate(s, strategies, book)
    rows = []
    for p in predictions:
        row = prediction_row(p, s, book, f"adhoc {spec.model}")
        row.extra["adhoc"] = {**dataclasses.asdict(spec), "overrides": list(spec.overrides)}
        rows.append(row)
    return predictions, rows


def write_rows(results_dir: Path, rows: list[Row], replace: bool) -> Path:
    """Write simulated rows to ``results_dir/simulated.parquet`` (replacing it, or appending)."""
    labels = Labels("simulated", {**versions()}, git_commit())
    path = results_dir / f"{SUITE}.parquet"
    results_dir.mkdir(parents=True, exist_ok=True)
    records = pd.DataFrame(
        [to_record(r, dataclasses.replace(labels, hardware=f"simulated: {_cluster(r)}")) for r in rows],
        columns=list(COLUMNS),
    )
    if not replace and path.exists():
        records = pd.concat([read_file(path), records], ignore_index=True)
    records.to_parquet(path, index=False)
    return path


def regenerate(
    results_dir: Path, overrides: dict[str, float] | None = None
) -> tuple[Path, list[Row], CostBook, Validation]:
    """Rewrite ``results_dir/simulated.parquet``: costs from the measured rows beside it (plus user
    ``overrides``), then every figure's setup, every built-in user setup and every recorded ad-hoc setup."""
    measured = measured_rows(results_dir)
    base = costs_from_rows(measured)
    if overrides:
        base = base.with_values(overrides, "set by --cost/--costs")
    judged = validate_all(base, measured)
    book = judged.fit.book if judged.fit else base
    rows = simulated_rows(book, judged, measured)
    for spec, names in _recorded_adhoc(results_dir / f"{SUITE}.parquet"):
        rows += adhoc_rows(spec, parse_sim_strategies(",".join(names)), book)[1]
    return write_rows(results_dir, rows, replace=True), rows, book, judged


def _recorded_adhoc(path: Path) -> list[tuple[Spec, list[str]]]:
    """Ad-hoc setups recorded in ``path`` (each once, with the strategies recorded for it)."""
    if not path.exists():
        return []
    import json

    specs: dict[str, list[str]] = {}
    for extra, strategy in zip(read_file(path)["extra"], read_file(path)["strategy"], strict=True):
        data = json.loads(extra).get("adhoc") if isinstance(extra, str) else None
        if data:
            key = json.dumps(data, sort_keys=True)
            specs.setdefault(key, [])
            if strategy not in specs[key]:
                specs[key].append(str(strategy))
    out = []
    for key, names in specs.items():
        data = json.loads(key)
        data["overrides"] = tuple(data.get("overrides", ()))
        out.append((Spec(**data), names))
    return out


def _cluster(r: Row) -> str:
    return Cluster.parse(str(r.extra["cluster"])).label()
