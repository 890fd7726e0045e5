"""What no measurement of ours can set, fitted openly on a declared training set of published figures.

Five physical parameters have no row of ours behind them (``kvmove.bench.sim.matching`` declares no setup that
measures them), and each is fitted on the published figures :data:`TRAINING` names for it:

- ``nic_efficiency``: RDMA/NCCL traffic through a node's NICs over their line rate (our rows cross NVLink only);
- ``reload_layer_s``: a GPU engine's layer-wise reload, per decoder layer (our vLLM rows run vLLM's CPU engine);
- ``host_register_s_per_byte``: registering and staging host memory for RDMA (mooncake), per byte;
- ``loader_tensor_s``: a serving engine's own weight loader (vLLM's, SGLang's ``load_weights``), per tensor;
- ``packed_bucket_s``: vLLM's packed NCCL weight-transfer consumer, per buffer it takes.

The training set holds at most one figure per source; every other figure is held out and only validates. Each
parameter is found by a golden-section search of its log over its bounds, minimizing the squared log errors of
its training figures, parameters in turn (a few sweeps). Leave-one-source-out: the same fit without any figure
of one source (a parameter left without training figures keeps its default), then that source is predicted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from kvmove.bench.sim.costs import Cost, CostBook, RowRef, replace_cost
from kvmove.bench.sim.figures import FIGURES, Figure
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.errors import KvmoveError


class Param(NamedTuple):
    """A fitted parameter: its cost name and the physical range searched."""

    name: str
    low: float
    high: float


PARAMS = (
    Param("nic_efficiency", 0.05, 1.0),
    Param("reload_layer_s", 1e-5, 1.0),
    Param("host_register_s_per_byte", 1e-14, 1e-8),
    Param("loader_tensor_s", 1e-6, 1e-2),
    Param("packed_bucket_s", 1e-5, 1.0),
)

TRAINING: dict[str, tuple[str, ...]] = {
    "nic_efficiency": ("pplx-kimi",),
    "reload_layer_s": ("vllm-qwen3-v2",),
    "host_register_s_per_byte": ("lmsys-qwen3-235b-rdma",),
    "loader_tensor_s": ("ckpt-qwen3-235b-8xh800-broadcast",),
    "packed_bucket_s": ("skyrl-qwen3-broadcast",),
}
"""Parameter -> the published figures it is fitted on (one per source over the whole set); all others held out."""

SWEEPS = 2
STEPS = 24


class Fitted(NamedTuple):
    """One fitted value and the figures it was fitted on (empty: no training figure left, default kept)."""

    name: str
    value: float
    figures: tuple[str, ...]
    at_bound: bool


class Fit(NamedTuple):
    """The book with fitted values, each with its training figures."""

    book: CostBook
    values: dict[str, Fitted]
    left_out: str | None


def training_keys() -> set[str]:
    return {k for keys in TRAINING.values() for k in keys}


def check_training(figures: tuple[Figure, ...] = FIGURES) -> None:
    """A KvmoveError unless every training figure exists and no source gives two."""
    by_key = {f.key: f for f in figures}
    sources: dict[str, str] = {}
    for key in sorted(training_keys()):
        if key not in by_key:
            raise KvmoveError(f"training figure {key!r} is not a published figure")
        src = by_key[key].source
        if src in sources:
            raise KvmoveError(f"training set takes two figures of {src!r}: {sources[src]} and {key}")
        sources[src] = key


def predicted(f: Figure, book: CostBook) -> float:
    (p,) = simulate(f.spec.build(), [SIM_STRATEGIES[f.strategy]], book)
    return p.bytes_moved if f.metric == "bytes" else p.seconds


def fit(book: CostBook, figures: tuple[Figure, ...] = FIGURES, leave_out: str | None = None) -> Fit:
    """Fit every parameter of :data:`PARAMS` on its training figures (without source ``leave_out``'s)."""
    check_training(FIGURES)
    by_key = {f.key: f for f in figures}
    train = {
        p.name: tuple(by_key[k] for k in TRAINING[p.name] if k in by_key and by_key[k].source != leave_out)
        for p in PARAMS
    }
    current = book
    for _ in range(SWEEPS):
        for p in PARAMS:
            if train[p.name]:
                current = _set(current, p.name, _search(p, train[p.name], current), train[p.name])
    values = {
        p.name: Fitted(
            p.name,
            current[p.name],
            tuple(f.key for f in train[p.name]),
            bool(train[p.name]) and min(abs(math.log(current[p.name] / b)) for b in (p.low, p.high)) < 1e-3,
        )
        for p in PARAMS
    }
    return Fit(current, values, leave_out)


def _set(book: CostBook, name: str, value: float, figures: tuple[Figure, ...]) -> CostBook:
    """``book`` with ``name`` fitted: its rows are the training figures (suite "published")."""
    note = "fitted on published figures " + ", ".join(f.key for f in figures) + " (training set; not held out)"
    refs = tuple(RowRef("published", "published", f.key, f.what, f.url) for f in figures)
    return replace_cost(book, Cost(name, value, "fitted", refs, note))


def _search(p: Param, figures: tuple[Figure, ...], book: CostBook) -> float:
    """Golden-section search of log(value) in [low, high] for the least squared log error on ``figures``."""

    def loss(x: float) -> float:
        trial = _set(book, p.name, math.exp(x), figures)
        return sum(math.log(predicted(f, trial) / f.value) ** 2 for f in figures)

    return math.exp(_golden(loss, math.log(p.low), math.log(p.high)))


def _golden(loss: Callable[[float], float], a: float, b: float) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    lc, ld = loss(c), loss(d)
    for _ in range(STEPS):
        if lc <= ld:
            b, d, ld = d, c, lc
            c = b - ratio * (b - a)
            lc = loss(c)
        else:
            a, c, lc = c, d, ld
            d = a + ratio * (b - a)
            ld = loss(d)
    best = min(((lc, c), (ld, d), (loss(a), a), (loss(b), b)))
    return best[1]


def leave_one_source_out(
    book: CostBook, figures: tuple[Figure, ...] = FIGURES, full: Fit | None = None
) -> dict[str, float]:
    """Figure key -> its prediction by the fit made without any figure of its source (a source with no training
    figure leaves the fit as it is: ``full``, when given, is reused)."""
    out: dict[str, float] = {}
    trained = {f.source for f in figures if f.key in training_keys()}
    for source in dict.fromkeys(f.source for f in figures):
        refit = full if full is not None and source not in trained else fit(book, figures, leave_out=source)
        for f in figures:
            if f.source == source:
                out[f.key] = predicted(f, refit.book)
    return out
