"""The simulator's results as DataFrames: predictions, the validation table, the cost book (library only)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvmove.bench.sim.costs import SPECS, CostBook
from kvmove.bench.sim.pricing import Prediction
from kvmove.bench.sim.validation import Validation, orders, summary

VALIDATION_COLUMNS = (
    "figure",
    "setup",
    "role",
    "strategy",
    "metric",
    "published",
    "predicted",
    "error_pct",
    "loso_error_pct",
    "pass_spread_pct",
    "speed_of_light",
    "binding_link",
    "source",
)


def predictions_frame(predictions: list[Prediction]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "strategy": p.strategy,
                "seconds": p.seconds,
                "GB/s": p.gbps,
                "bytes": p.bytes_moved,
                "speed_of_light_s": p.speed_of_light_seconds,
                "receiver_bound_s": p.receiver_bound_seconds,
                "x_sol": p.sol_ratio,
                "binding_link": p.binding_link,
                **{f"{k}_s": v for k, v in p.phases.items()},
            }
            for p in predictions
        ]
    )


def validation_records(v: Validation) -> list[dict[str, Any]]:
    """One record per published figure (value, role, prediction, error, leave-one-source-out error, source)
    and per held-out measured run of ours, good or bad (with the spread between its passes, where it ran twice)."""
    recs: list[dict[str, Any]] = []
    for c in v.checks:
        f = c.figure
        recs.append(
            {
                "figure": f.key,
                "setup": f.what,
                "role": c.role,
                "strategy": f.strategy,
                "metric": f.metric,
                "published": f.value,
                "predicted": c.predicted,
                "error_pct": c.error_pct,
                "loso_error_pct": c.loso_error_pct,
                "pass_spread_pct": None,
                "speed_of_light": c.prediction.speed_of_light_seconds,
                "binding_link": c.prediction.binding_link,
                "source": f.url,
            }
        )
    for o in v.own:
        recs.append(
            {
                "figure": o.run.key,
                "setup": o.run.what,
                "role": o.run.role,
                "strategy": o.run.strategy,
                "metric": "seconds",
                "published": o.run.measured,
                "predicted": o.predicted,
                "error_pct": o.error_pct,
                "loso_error_pct": None,
                "pass_spread_pct": o.run.pass_spread_pct,
                "speed_of_light": None,
                "binding_link": "",
                "source": "; ".join(sorted({r.label() for r in o.run.rows})),
            }
        )
    return recs


def validation_frame(v: Validation) -> pd.DataFrame:
    return pd.DataFrame(validation_records(v), columns=list(VALIDATION_COLUMNS))


def fitted_records(v: Validation) -> list[dict[str, Any]]:
    """Each fitted parameter: value, whether it sits at a bound of its range, the figures it was fitted on."""
    if v.fit is None:
        return []
    return [
        {"fitted": f.name, "value": f.value, "at_bound": f.at_bound, "training_figures": list(f.figures)}
        for f in v.fit.values.values()
    ]


def split_records(v: Validation) -> list[dict[str, Any]]:
    """Every recorded CPU split's held-out runs, scored with today's model (oldest first)."""
    return [s._asdict() for s in v.cpu_splits]


def splits_line(v: Validation) -> str:
    """One line: each recorded CPU split's median and worst error and how many runs were within 25%."""
    if not v.cpu_splits:
        return "no recorded CPU split"
    parts = [
        f"{s.commit[:7]} ({s.parallel_copies:.2g} parallel copies) median {s.median_abs_error_pct:.0f}%, worst "
        f"{s.worst_error_pct:+.0f}%, {s.within_25} of {s.runs} within 25%"
        for s in v.cpu_splits
    ]
    return "our held-out CPU runs on every recorded split (oldest first): " + "; ".join(parts)


def summary_line(v: Validation) -> str:
    s = summary(v.checks, v.own)
    if not s:
        return "no published time figures"
    kept = orders(v.checks)
    text = (
        f"{int(s['held_out_figures'])} held-out time figures: median |error| {s['held_out_median_abs_error_pct']:.0f}%"
        f" ({int(s['held_out_within_30_pct'])} within 30%); {int(s['training_figures'])} training figures: median "
        f"{s['training_median_abs_error_pct']:.0f}%; leave-one-source-out median "
        f"{s.get('loso_median_abs_error_pct', float('nan')):.0f}%; vLLM sharded figures worst "
        f"{s.get('vllm_sharded_worst_abs_error_pct', float('nan')):.0f}%; published orders kept "
        f"{sum(k for _, _, k in kept)}/{len(kept)}"
    )
    for prefix, what in (("own", "our held-out one-GPU runs"), ("cpu", "our held-out CPU runs")):
        if f"{prefix}_runs" in s:
            text += (
                f"; {what} worst |error| {s[f'{prefix}_worst_abs_error_pct']:.0f}%, median "
                f"{s[f'{prefix}_median_abs_error_pct']:.0f}% ({int(s[f'{prefix}_runs'])} runs)"
            )
    return text


def costs_frame(book: CostBook) -> pd.DataFrame:
    """Every cost: value, unit, kind (measured/derived/fitted/default/user), the rows it came from."""
    recs = []
    for name, c in book.costs.items():
        refs = sorted({r.label() for r in c.rows})
        recs.append(
            {
                "cost": name,
                "value": c.value,
                "unit": SPECS[name].unit,
                "kind": c.kind,
                "rows": len(c.rows),
                "commits": ", ".join(c.commits()),
                "from": c.note,
                "example_row": refs[0] if refs else "",
            }
        )
    return pd.DataFrame(recs)
