"""Every published figure next to the simulator's prediction of its setup, with the error, good or bad.

Figures of the declared training set (``kvmove.bench.sim.fitting.TRAINING``) set the fitted parameters and are
labelled "training"; every other figure is "held-out". Each figure also carries its leave-one-source-out
prediction (the fit made without any figure of its source). kvmove's own held-out measured runs
(``kvmove.bench.sim.ownruns``) are judged in the same table.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import pandas as pd

from kvmove.bench.sim.costs import CostBook
from kvmove.bench.sim.cpuruns import TARGET, SplitScore, cpu_book, cpu_checks, cpu_splits, split_score
from kvmove.bench.sim.figures import FIGURES, ORDERS, Figure
from kvmove.bench.sim.fitting import Fit, fit, leave_one_source_out
from kvmove.bench.sim.ownruns import OwnCheck, one_gpu_book, own_checks
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.pricing import Prediction
from kvmove.bench.sim.setup import SimSetup
from kvmove.bench.sim.strategies import SIM_STRATEGIES

SHARDED = ("vllm-qwen3-v1", "vllm-qwen3-v2", "vllm-qwen3-v3", "vllm-kimi-v3")
"""The vLLM sharded-transfer figures, each to be within 30%."""


class Check(NamedTuple):
    """One figure, its prediction, whether the figure set a cost (training) and its leave-one-source-out
    prediction (None when not computed)."""

    figure: Figure
    prediction: Prediction
    used_for_costs: bool
    loso: float | None = None

    @property
    def predicted(self) -> float:
        return self.prediction.bytes_moved if self.figure.metric == "bytes" else self.prediction.seconds

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted / self.figure.value - 1.0)

    @property
    def role(self) -> str:
        return "training" if self.used_for_costs else "held-out"

    @property
    def loso_error_pct(self) -> float | None:
        return None if self.loso is None else 100.0 * (self.loso / self.figure.value - 1.0)


class Validation(NamedTuple):
    """The whole judgement: published figures (with the fit) and our own held-out runs (one-GPU and CPU), with the
    cost book of each target that predicted them, and every recorded CPU split scored (``own`` holds the newest's
    runs)."""

    checks: list[Check]
    fit: Fit | None
    own: list[OwnCheck]
    own_books: dict[str, CostBook]
    cpu_splits: list[SplitScore]


def figure_setup(f: Figure) -> SimSetup:
    """The setup a figure describes, as the simulator takes it."""
    return f.spec.build()


def used_for_costs(f: Figure, book: CostBook) -> bool:
    """Whether any cost names this figure among the rows it came from (a fitted parameter's training figure)."""
    return any(r.suite == "published" and r.name == f.key for c in book.costs.values() for r in c.rows)


def validate(
    book: CostBook, figures: tuple[Figure, ...] = FIGURES, loso: dict[str, float] | None = None
) -> list[Check]:
    """Predict every figure's setup with ``book``."""
    out = []
    for f in figures:
        (p,) = simulate(figure_setup(f), [SIM_STRATEGIES[f.strategy]], book)
        out.append(Check(f, p, used_for_costs(f, book), (loso or {}).get(f.key)))
    return out


def validate_all(measured: CostBook, rows: pd.DataFrame | None, figures: tuple[Figure, ...] = FIGURES) -> Validation:
    """Fit on the training figures, predict every figure (and leave each source out), judge our own runs."""
    splits = cpu_splits(rows)
    newest = splits[-1] if splits else None
    fitted, books = fit(measured, figures), {"one-gpu": one_gpu_book(rows), TARGET: cpu_book(rows, newest)}
    checks = validate(fitted.book, figures, leave_one_source_out(measured, figures, fitted))
    cpu = [cpu_checks(rows, split) for split in splits]
    own = own_checks(rows, books["one-gpu"]) + (cpu[-1] if cpu else [])
    scores = [split_score(split, runs) for split, runs in zip(splits, cpu, strict=True) if runs]
    return Validation(checks, fitted, own, books, scores)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(checks: list[Check], own: list[OwnCheck] | None = None) -> dict[str, float]:
    """Median |error| of training, held-out and leave-one-source-out time figures; the sharded vLLM figures'
    worst |error|; our own held-out runs' worst and median |error| (one-GPU: ``own_``, CPU: ``cpu_``); counts
    within 25%/30% and 2x."""
    timed = [c for c in checks if c.figure.metric == "seconds"]
    if not timed:
        return {}
    held = [abs(c.error_pct) for c in timed if not c.used_for_costs]
    ratios = [c.predicted / c.figure.value for c in timed]
    out = {
        "figures": float(len(timed)),
        "training_figures": float(len(timed) - len(held)),
        "training_median_abs_error_pct": _median([abs(c.error_pct) for c in timed if c.used_for_costs]),
        "held_out_figures": float(len(held)),
        "held_out_median_abs_error_pct": _median(held),
        "median_abs_error_pct": _median([abs(c.error_pct) for c in timed]),
        "worst_abs_error_pct": max(abs(c.error_pct) for c in timed),
        "within_25_pct": float(sum(abs(c.error_pct) <= 25 for c in timed)),
        "held_out_within_30_pct": float(sum(e <= 30 for e in held)),
        "within_2x": float(sum(0.5 <= r <= 2 for r in ratios)),
    }
    loso = [abs(c.loso_error_pct) for c in timed if c.loso_error_pct is not None]
    if loso:
        out["loso_median_abs_error_pct"] = _median(loso)
    sharded = [abs(c.error_pct) for c in timed if c.figure.key in SHARDED]
    if sharded:
        out["vllm_sharded_worst_abs_error_pct"] = max(sharded)
    for prefix, runs in (("own", [o for o in own or [] if o.run.target != TARGET]),
                         ("cpu", [o for o in own or [] if o.run.target == TARGET])):  # fmt: skip
        if runs:
            out[f"{prefix}_runs"] = float(len(runs))
            out[f"{prefix}_worst_abs_error_pct"] = max(abs(o.error_pct) for o in runs)
            out[f"{prefix}_median_abs_error_pct"] = _median([abs(o.error_pct) for o in runs])
    return out


def orders(checks: list[Check]) -> list[tuple[str, str, bool]]:
    """Each published order (slower figure, faster figure) and whether the predictions keep it."""
    by_key = {c.figure.key: c.predicted for c in checks}
    return [(a, b, bool(by_key[a] > by_key[b])) for a, b in ORDERS if a in by_key and b in by_key]
