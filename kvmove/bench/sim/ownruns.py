"""The simulator judged on our own measurements: held-out runs of ours that set no cost, predicted.

The one-GPU matrix (``kvmove bench run --suite gpu --gpus 1``) syncs a 2-layer slice of Qwen3-235B-A22B in
several layouts, colocated on one H200; the same machine also synced the 2-layer and an 8-layer slice in BF16 and in
FP8 (``--suite gpu-fp8 --layers 2`` and ``--layers 8``, one commit). Costs for the ``one-gpu`` target come from the
2-layer rows only (:data:`TRAIN_LAYERS`); every 8-layer row of the newest commit that has them is held out and
predicted. The target is the GPU those runs used (an H200, :data:`ONE_GPU`): rows of another GPU (an H100's
matrix) set none of its costs and are not held out.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import pandas as pd

from kvmove.bench.sim.costs import CostBook, RowRef
from kvmove.bench.sim.matching import model_layers
from kvmove.bench.sim.measure import costs_from_rows
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.samples import decorated, row_ref
from kvmove.bench.sim.setup import Spec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.models.layout import split_label

TRAIN_LAYERS = 2
"""Rows of this slice set the one-GPU costs; rows of any other slice are held out."""
ONE_GPU = "h200"
"""The GPU of the one-GPU target: its rows set the costs, its rows are held out."""
ONE_GPU_CLUSTER = f"gpu={ONE_GPU},nic=cx7-400,gpus_per_node=1,nics_per_node=1"


class OwnRun(NamedTuple):
    """A held-out measured setup: the median of its warm syncs, the rows behind it, the setup to predict, the cost
    target that predicts it and what set that target's costs."""

    key: str
    what: str
    measured: float
    rows: tuple[RowRef, ...]
    spec: Spec
    strategy: str
    target: str = "one-gpu"
    basis: str = f"costs from the {TRAIN_LAYERS}-layer one-GPU rows only (target one-gpu)"
    passes: tuple[float, ...] = ()
    """The median of each pass's warm syncs, in the order they ran, where the setup was run more than once at its
    commit (a recording in ABBA order): how well the measurement repeats itself."""

    @property
    def pass_spread_pct(self) -> float | None:
        """The slowest pass's median less the fastest's, over :attr:`measured` (%); None with fewer than two passes:
        an error of the prediction smaller than this is within what the measurement itself does not repeat."""
        if len(self.passes) < 2:
            return None
        return 100.0 * (max(self.passes) - min(self.passes)) / self.measured

    @property
    def role(self) -> str:
        """Its role in the validation table: ``held-out (ours)``, or with the target (``held-out (ours, CPU)``)."""
        return "held-out (ours)" if self.target == "one-gpu" else f"held-out (ours, {self.target.upper()})"


class OwnCheck(NamedTuple):
    run: OwnRun
    predicted: float
    book: CostBook | None = None
    """The costs that predicted it, where they are not its target's one book (CPU runs: their training run's)."""

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted / self.run.measured - 1.0)


def one_gpu_book(rows: pd.DataFrame | None) -> CostBook:
    """Costs for kvmove's colocated one-GPU syncs: rows of the :data:`TRAIN_LAYERS`-layer slice (the matrix, and
    the gpu-fp8 suite's BF16 and FP8 syncs of that slice: the quantization rate) and rows of no slice (ceilings,
    micro-benchmarks); no row of a held-out slice, of any commit."""
    return costs_from_rows(rows, "one-gpu", keep=lambda r: _on_one_gpu(r) and model_layers(r) in (None, TRAIN_LAYERS))


def _on_one_gpu(r: pd.Series) -> bool:
    """Whether a decorated row ran on the target's GPU model, its ``gpu`` preset (a CPU host's rows are left to the
    matching)."""
    return r["hardware"].startswith("cpu") or (r["gpu"] is not None and r["gpu"].name == ONE_GPU)


def _candidates(rows: pd.DataFrame | None) -> pd.DataFrame | None:
    """Warm, verified colocated one-GPU sync rows of slices other than the training slice, oldest first."""
    if rows is None or rows.empty:
        return None
    df = decorated(rows)
    df = df[df["gpu"].notna() & (df["strategy"].fillna("") != "")]
    df = df[df["setup"].map(lambda s: s.placement == "colocated" and s.gpus == 1 and s.gather == "none")]
    slices = [_on_one_gpu(r) and model_layers(r) not in (None, TRAIN_LAYERS) for _, r in df.iterrows()]
    df = df[pd.Series(slices, index=df.index, dtype=bool)]  # a mask, so an empty frame keeps its columns
    df = df[df["extra_d"].map(lambda e: e.get("verified") is not False and int(e.get("sync", 2)) >= 2)]
    return None if df.empty else df


def held_out_runs(rows: pd.DataFrame | None) -> list[OwnRun]:
    """Warm colocated one-GPU sync rows of any other slice, newest commit that has them, one run per setup."""
    df = _candidates(rows)
    if df is None:
        return []
    newest = df["git_commit"].iloc[-1]
    df = df[df["git_commit"] == newest]
    out = []
    dtype = df["extra_d"].map(lambda e: str(e.get("engine_dtype", "bf16")))
    for (strategy, dt, trainer, engine), g in df.groupby([df["strategy"], dtype, df["trainer"], df["engine"]]):
        r = g.iloc[0]
        layers = model_layers(r)
        layout, reps = split_label(engine)
        spec = Spec(
            str(r["model"]), str(trainer), layout, reps, 1, 1, ONE_GPU_CLUSTER, "colocated", "cuda-ipc",
            dtype=str(dt), quantize_on="trainer" if dt == "fp8" else "engine",
            direct=bool(r["extra_d"].get("direct", False)), overrides=(f"num_hidden_layers={layers}",),
        )  # fmt: skip
        what = f"{r['model']} {layers} layers {dt.upper()} {strategy} {trainer} -> {engine}, one H200 colocated"
        key = f"own-{layers}l-{dt}-{strategy}"
        out.append(OwnRun(key, what, statistics.median(g["seconds"]), tuple(row_ref(x) for _, x in g.iterrows()),
                          spec, str(strategy)))  # fmt: skip
    return out


def own_checks(rows: pd.DataFrame | None, book: CostBook | None = None) -> list[OwnCheck]:
    """Every held-out run of ours next to its prediction from the training-slice costs (``book``, else
    :func:`one_gpu_book` of ``rows``)."""
    book = book or one_gpu_book(rows)
    out = []
    for run in held_out_runs(rows):
        (p,) = simulate(run.spec.build(), [SIM_STRATEGIES[run.strategy]], book)
        out.append(OwnCheck(run, p.seconds))
    return out
