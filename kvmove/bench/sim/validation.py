"""Every published figure next to the simulator's prediction of its setup, with the error, good or bad."""

from __future__ import annotations

from typing import NamedTuple

from kvmove.bench.sim.costs import CostBook
from kvmove.bench.sim.figures import FIGURES, Figure
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.pricing import Prediction
from kvmove.bench.sim.setup import SimSetup
from kvmove.bench.sim.strategies import SIM_STRATEGIES


class Check(NamedTuple):
    """One figure, its prediction, and whether the figure set any cost (it must not)."""

    figure: Figure
    prediction: Prediction
    used_for_costs: bool

    @property
    def predicted(self) -> float:
        return self.prediction.bytes_moved if self.figure.metric == "bytes" else self.prediction.seconds

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted / self.figure.value - 1.0)


def figure_setup(f: Figure) -> SimSetup:
    """The setup a figure describes, as the simulator takes it."""
    return f.spec.build()


def used_for_costs(f: Figure, book: CostBook) -> bool:
    """Whether any cost names this figure (or any published source) among the rows it came from."""
    return any(r.suite == "published" or f.key in r.name for c in book.costs.values() for r in c.rows)


def validate(book: CostBook, figures: tuple[Figure, ...] = FIGURES) -> list[Check]:
    """Predict every figure's setup with ``book``."""
    out = []
    for f in figures:
        (p,) = simulate(figure_setup(f), [SIM_STRATEGIES[f.strategy]], book)
        out.append(Check(f, p, used_for_costs(f, book)))
    return out


def summary(checks: list[Check]) -> dict[str, float]:
    """Median and worst absolute error over the time figures, and how many lie within 25% and within 2x."""
    errors = sorted(abs(c.error_pct) for c in checks if c.figure.metric == "seconds")
    if not errors:
        return {}
    ratios = [c.predicted / c.figure.value for c in checks if c.figure.metric == "seconds"]
    return {
        "figures": float(len(errors)),
        "median_abs_error_pct": errors[len(errors) // 2],
        "worst_abs_error_pct": errors[-1],
        "within_25_pct": float(sum(e <= 25 for e in errors)),
        "within_2x": float(sum(0.5 <= r <= 2 for r in ratios)),
    }
