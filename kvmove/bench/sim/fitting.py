"""What no measurement of ours can set, fitted openly and jointly on a declared training set of published figures.

Five physical parameters have no row of ours behind them (``kvmove.bench.sim.matching`` declares no setup that
measures them):

- ``nic_efficiency``: RDMA/NCCL traffic through a node's NICs over their line rate (our rows cross NVLink only);
- ``reload_layer_s``: a GPU engine's layer-wise reload, per decoder layer (our vLLM rows run vLLM's CPU engine);
- ``host_register_s_per_byte``: registering and staging host memory for RDMA (mooncake), per byte;
- ``loader_tensor_s``: a serving engine's own weight loader (vLLM's, SGLang's ``load_weights``), per tensor;
- ``packed_bucket_s``: vLLM's packed NCCL weight-transfer consumer, per buffer it takes.

:data:`TRAINING` names at most one figure per source and the parameters each one informs (the costs its setup is
priced with); every other figure is held out and only validates. All parameters are fitted together, least squared
log error over every training figure (:func:`fit`: Levenberg-Marquardt in the parameters' logs, inside their
physical ranges), so a parameter two sources inform is still fitted when one of them is left out. Leave-one-source-
out: the same fit without any figure of one source (a parameter no remaining figure informs keeps its default,
``kvmove.bench.sim.costs.SPECS``), then that source is predicted.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

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
    "pplx-kimi": ("nic_efficiency",),
    "vllm-qwen3-v2": ("reload_layer_s", "nic_efficiency"),
    "lmsys-qwen3-235b-rdma": ("nic_efficiency", "host_register_s_per_byte"),
    "ckpt-qwen3-235b-8xh800-p2p": ("loader_tensor_s", "host_register_s_per_byte", "nic_efficiency"),
    "skyrl-qwen3-broadcast": ("packed_bucket_s", "nic_efficiency"),
    "slime-qwen3-30b-colocated": ("loader_tensor_s",),
}
"""Training figure (one per source) -> the parameters it informs: those that move its prediction by a factor of
:data:`INFORMS` or more across their range (tests check both ways). Every other figure is held out. The engine's
own loader has two sources (checkpoint-engine's vLLM and slime's SGLang, both landing tensor by tensor); two
parameters are informed by one training figure only (the vLLM post's layer-wise reload, SkyRL's packed consumer):
leaving that source out leaves them at their cited defaults."""

INFORMS = 3.0
"""A figure informs a parameter when its prediction at the parameter's high bound and at its low bound differ by
this factor or more (the other parameters at their fitted values)."""

ITERATIONS = 30
STEP = 0.05
"""Forward-difference step of the Jacobian, in the log of a parameter."""
TOLERANCE = 1e-4


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
    return set(TRAINING)


def informing(name: str, keys: set[str] | None = None) -> tuple[str, ...]:
    """The training figures (of ``keys``, default all) that inform parameter ``name``."""
    return tuple(k for k, names in TRAINING.items() if name in names and (keys is None or k in keys))


def check_training(figures: tuple[Figure, ...] = FIGURES) -> None:
    """A KvmoveError unless every training figure exists, no source gives two, every named parameter is one of
    :data:`PARAMS` and every parameter has a training figure."""
    by_key = {f.key: f for f in figures}
    sources: dict[str, str] = {}
    known = {p.name for p in PARAMS}
    for key in sorted(TRAINING):
        if key not in by_key:
            raise KvmoveError(f"training figure {key!r} is not a published figure")
        unknown = set(TRAINING[key]) - known
        if unknown:
            raise KvmoveError(f"training figure {key!r} informs unknown parameters {sorted(unknown)}")
        src = by_key[key].source
        if src in sources:
            raise KvmoveError(f"training set takes two figures of {src!r}: {sources[src]} and {key}")
        sources[src] = key
    orphans = [p.name for p in PARAMS if not informing(p.name)]
    if orphans:
        raise KvmoveError(f"no training figure informs {', '.join(orphans)}")


def predicted(f: Figure, book: CostBook) -> float:
    (p,) = simulate(f.spec.build(), [SIM_STRATEGIES[f.strategy]], book)
    return p.bytes_moved if f.metric == "bytes" else p.seconds


def fit(book: CostBook, figures: tuple[Figure, ...] = FIGURES, leave_out: str | None = None) -> Fit:
    """Fit every parameter some training figure of ``figures`` informs (none of source ``leave_out``'s), jointly;
    the others keep their values in ``book``."""
    check_training(FIGURES)
    train = tuple(f for f in figures if f.key in TRAINING and f.source != leave_out)
    keys = {f.key for f in train}
    free = tuple(p for p in PARAMS if informing(p.name, keys))
    x = _solve(book, free, train)
    current = book
    for p, value in zip(free, np.exp(x), strict=True):
        current = _set(current, p.name, float(value), tuple(by for by in train if by.key in informing(p.name)))
    values = {
        p.name: Fitted(
            p.name,
            current[p.name],
            informing(p.name, keys),
            p in free and min(abs(math.log(current[p.name] / b)) for b in (p.low, p.high)) < 1e-3,
        )
        for p in PARAMS
    }
    return Fit(current, values, leave_out)


def _set(book: CostBook, name: str, value: float, figures: tuple[Figure, ...]) -> CostBook:
    """``book`` with ``name`` fitted: its rows are the training figures (suite "published")."""
    note = "fitted jointly on published figures " + ", ".join(f.key for f in figures) + " (training set; not held out)"
    refs = tuple(RowRef("published", "published", f.key, f.what, f.url) for f in figures)
    return replace_cost(book, Cost(name, value, "fitted", refs, note))


def _at(book: CostBook, free: tuple[Param, ...], x: np.ndarray) -> CostBook:
    for p, value in zip(free, np.exp(x), strict=True):
        book = replace_cost(book, Cost(p.name, float(value), "fitted"))
    return book


def _residuals(book: CostBook, train: tuple[Figure, ...]) -> np.ndarray:
    return np.array([math.log(predicted(f, book) / f.value) for f in train])


def _solve(book: CostBook, free: tuple[Param, ...], train: tuple[Figure, ...]) -> np.ndarray:
    """Levenberg-Marquardt on the logs of ``free``, each kept in its range, for the least squared log error of
    ``train``; starts from ``book``'s values (clipped into range). A parameter at a bound its gradient pushes
    against stays there for that step."""
    lo = np.log([p.low for p in free])
    hi = np.log([p.high for p in free])
    x = np.clip(np.log([max(book[p.name], p.low) for p in free]), lo, hi)
    if not free:
        return x
    r = _residuals(_at(book, free, x), train)
    damping = 1e-3
    for _ in range(ITERATIONS):
        jac = _jacobian(book, free, train, x, r, hi)
        grad = jac.T @ r
        movable = ~(((x <= lo + 1e-9) & (grad > 0)) | ((x >= hi - 1e-9) & (grad < 0)))
        if not movable.any():
            break
        step = _damped_step(book, free, train, x, r, jac, grad, movable, lo, hi, damping)
        if step is None:
            break
        x_new, r_new, damping = step
        done = float(np.max(np.abs(x_new - x))) < TOLERANCE
        x, r = x_new, r_new
        if done:
            break
    return x


def _jacobian(
    book: CostBook, free: tuple[Param, ...], train: tuple[Figure, ...], x: np.ndarray, r: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    jac = np.zeros((len(train), len(free)))
    for j in range(len(free)):
        h = STEP if x[j] + STEP <= hi[j] else -STEP
        moved = x.copy()
        moved[j] += h
        jac[:, j] = (_residuals(_at(book, free, moved), train) - r) / h
    return jac


def _damped_step(
    book: CostBook,
    free: tuple[Param, ...],
    train: tuple[Figure, ...],
    x: np.ndarray,
    r: np.ndarray,
    jac: np.ndarray,
    grad: np.ndarray,
    movable: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    damping: float,
) -> tuple[np.ndarray, np.ndarray, float] | None:
    """One accepted Levenberg-Marquardt step (the damping raised until the loss falls), or None."""
    a = jac[:, movable].T @ jac[:, movable]
    loss = float(r @ r)
    while damping < 1e8:
        lhs = a + damping * (np.diag(np.diag(a)) + 1e-9 * np.eye(len(a)))
        delta = np.zeros_like(x)
        delta[movable] = np.linalg.lstsq(lhs, -grad[movable], rcond=None)[0]  # a flat direction moves nothing
        x_new = np.clip(x + delta, lo, hi)
        r_new = _residuals(_at(book, free, x_new), train)
        if float(r_new @ r_new) < loss:
            return x_new, r_new, max(damping / 3, 1e-7)
        damping *= 10
    return None


def leave_one_source_out(
    book: CostBook, figures: tuple[Figure, ...] = FIGURES, full: Fit | None = None
) -> dict[str, float]:
    """Figure key -> its prediction by the fit made without any figure of its source (a source with no training
    figure leaves the fit as it is: ``full``, when given, is reused)."""
    out: dict[str, float] = {}
    trained = {f.source for f in figures if f.key in TRAINING}
    for source in dict.fromkeys(f.source for f in figures):
        refit = full if full is not None and source not in trained else fit(book, figures, leave_out=source)
        for f in figures:
            if f.source == source:
                out[f.key] = predicted(f, refit.book)
    return out
