"""The simulator's results as DataFrames: predictions, the validation table, the cost book (library only)."""

from __future__ import annotations

import pandas as pd

from kvmove.bench.sim.costs import SPECS, CostBook
from kvmove.bench.sim.pricing import Prediction
from kvmove.bench.sim.validation import Check, summary

VALIDATION_COLUMNS = (
    "figure",
    "setup",
    "strategy",
    "metric",
    "published",
    "predicted",
    "error_pct",
    "used_for_costs",
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


def validation_frame(checks: list[Check]) -> pd.DataFrame:
    """One row per published figure: its value and source, the prediction and the error, good or bad."""
    recs = []
    for c in checks:
        f = c.figure
        recs.append(
            {
                "figure": f.key,
                "setup": f.what,
                "strategy": f.strategy,
                "metric": f.metric,
                "published": f.value,
                "predicted": c.predicted,
                "error_pct": c.error_pct,
                "used_for_costs": "yes" if c.used_for_costs else "no",
                "speed_of_light": c.prediction.speed_of_light_seconds,
                "binding_link": c.prediction.binding_link,
                "source": f.url,
            }
        )
    return pd.DataFrame(recs, columns=list(VALIDATION_COLUMNS))


def summary_line(checks: list[Check]) -> str:
    s = summary(checks)
    if not s:
        return "no published time figures"
    return (
        f"{int(s['figures'])} time figures: median |error| {s['median_abs_error_pct']:.0f}%, "
        f"worst {s['worst_abs_error_pct']:.0f}%, {int(s['within_25_pct'])} within 25%, "
        f"{int(s['within_2x'])} within 2x; no figure sets any cost"
    )


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
