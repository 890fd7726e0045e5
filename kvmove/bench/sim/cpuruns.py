"""The simulator judged on kvmove's CPU syncs: training runs' rows set the ``cpu`` target's costs, the rows of the
other setups (models or layouts) of the same commit are held out and predicted.

The sync suite (``kvmove bench run --suite sync``, ``kvmove.bench.syncs``) syncs a model between CPU processes of
one host (trainer and engine ranks as Ray actors; v1, v2 and v3 over NIXL on loopback, the broadcast over gloo) and
measures the raw loopback read of the same run (``extra.raw_gbps``): the host's line rate for its link and its
copies (``kvmove.bench.sim.hardware.host_of_run``). :func:`cpu_split` takes the newest commit whose CPU sync rows
hold two setups (models or layouts); the rows of a run that measured its raw read (the one moving the most bytes,
when several did) set the costs (``kvmove.bench.sim.matching.CPU``); so do the runs of its model and layouts at other
replica counts when the commit has them. Every other setup's warm rows are predicted at that run's rates, each from
the costs of the training run that shared the host with as many engine-rank processes (the nearest count, the
larger on a tie): on a host of a few cores the engine ranks polling for their pulls take cores from the trainer's
ranks, so a per-operation cost measured beside four engine ranks is not one measured beside two.
"""

from __future__ import annotations

import json
import statistics
from typing import NamedTuple

import pandas as pd

from kvmove.bench.results import json_dict
from kvmove.bench.sim.costs import CostBook
from kvmove.bench.sim.measure import costs_from_rows
from kvmove.bench.sim.ownruns import OwnCheck, OwnRun
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.samples import decorated, row_ref
from kvmove.bench.sim.setup import Spec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.models.layout import EngineLayout, TrainerLayout, split_label

TARGET = "cpu"


class Setup(NamedTuple):
    """One CPU sync run's setup: model and layouts as the rows spell them."""

    model: str
    trainer: str
    engine: str

    def label(self) -> str:
        return f"{self.model} {self.trainer} -> {self.engine}"


class CpuSplit(NamedTuple):
    """Which CPU rows of a commit set the costs (one run's setup) and which setups are predicted."""

    commit: str
    train: Setup
    held: tuple[Setup, ...]
    raw_gbps: float
    """The training run's raw loopback read (GB/s): the line rate of every prediction."""
    cores: float = 0
    """How many ranks' pulls progress at once on the host: the training run's device's (its hardware label's cores,
    fewer where its concurrent raw read says so: ``kvmove.bench.sim.hardware.parallel_of_run``)."""
    partners: tuple[Setup, ...] = ()
    """The training run's model and layouts at other replica counts: training runs too."""

    @property
    def training(self) -> tuple[Setup, ...]:
        return (self.train, *self.partners)

    def training_for(self, engine: str) -> Setup:
        """The training run whose engine-rank processes (every replica's) are nearest in number to ``engine``'s
        (an engine label, ``LAYOUT xN``), the larger on a tie."""
        n = engine_processes(engine)
        return min(self.training, key=lambda t: (abs(engine_processes(t.engine) - n), -engine_processes(t.engine)))


def engine_processes(engine: str) -> int:
    """Engine-rank processes of an engine label (``tp=2,ep=2 x2`` -> 4): every replica's ranks."""
    layout, reps = split_label(engine)
    return EngineLayout.parse(layout, reps).world


def _cpu_syncs(rows: pd.DataFrame | None) -> pd.DataFrame | None:
    """Decorated sync-suite rows of CPU processes, oldest first (every sync, cold ones included)."""
    if rows is None or rows.empty:
        return None
    df = decorated(rows)
    df = df[(df["suite"] == "sync") & (df["strategy"].fillna("") != "")]
    df = df[df["setup"].map(lambda s: s.device == "cpu" and s.path == "cpu")]
    df = df[df["extra_d"].map(lambda e: e.get("verified") is not False)]
    return None if df.empty else df


def _setup(r: pd.Series) -> Setup:
    return Setup(str(r["model"]), str(r["trainer"]), str(r["engine"]))


def cpu_splits(rows: pd.DataFrame | None) -> list[CpuSplit]:
    """Every commit whose CPU sync rows hold two setups (models or layouts), one of whose runs measured its raw
    loopback read, oldest first: that run (the one moving the most bytes, when several did) sets the costs with its
    model and layouts at other replica counts, the other setups are predicted."""
    df = _cpu_syncs(rows)
    if df is None:
        return []
    out = []
    for commit in dict.fromkeys(df["git_commit"]):
        at = df[df["git_commit"] == commit]
        runs = {_setup(g.iloc[0]): g for _, g in at.groupby(["model", "trainer", "engine"], sort=False)}
        raw = {k: max(float(e.get("raw_gbps") or 0.0) for e in g["extra_d"]) for k, g in runs.items()}
        measured = [k for k in runs if raw[k] > 0]
        if len(runs) < 2 or not measured:
            continue
        train = max(measured, key=lambda k: float(runs[k]["bytes"].max()))
        cores = float(runs[train]["gpu"].iloc[0].cores)
        partners = tuple(k for k in runs if k != train and _same_but_replicas(k, train))
        held = tuple(k for k in runs if k != train and k not in partners)
        if held:
            out.append(CpuSplit(str(commit), train, held, raw[train], cores, partners))
    return out


def _same_but_replicas(a: Setup, b: Setup) -> bool:
    return (a.model, a.trainer, split_label(a.engine)[0]) == (b.model, b.trainer, split_label(b.engine)[0])


def cpu_split(rows: pd.DataFrame | None) -> CpuSplit | None:
    """The newest of :func:`cpu_splits` (the one the validation table judges), None when no commit has such rows."""
    splits = cpu_splits(rows)
    return splits[-1] if splits else None


def cpu_book(rows: pd.DataFrame | None, split: CpuSplit | None = None, train: Setup | None = None) -> CostBook:
    """The ``cpu`` target's costs from one training run's rows (``train``, default the split's run that measured its
    raw read; defaults where none measure)."""
    split = split or cpu_split(rows)
    train = train or (split.train if split is not None else None)

    def keep(r: pd.Series) -> bool:
        return split is not None and r["git_commit"] == split.commit and _setup(r) == train

    if split is not None and train is not None:
        rows = _on_the_training_host(rows, split, train)
    return costs_from_rows(rows, TARGET, keep=keep)


def _on_the_training_host(rows: pd.DataFrame | None, split: CpuSplit, train: Setup) -> pd.DataFrame | None:
    """``rows`` with the training run's raw loopback read on those of ``train``'s rows that measured none (a
    partner's, or a run of the training setup through ``kvmove sync-weights``: the same host at the same commit,
    whose rates are its rates, as every prediction's are)."""
    if rows is None:
        return rows
    ours = [Setup(*s) == train for s in zip(rows["model"], rows["trainer"], rows["engine"], strict=True)]
    unread = [not json_dict(e).get("raw_gbps") for e in rows["extra"]]
    at = (rows["git_commit"] == split.commit) & (rows["kind"] == "measured")
    mask = at & pd.Series(ours, index=rows.index) & pd.Series(unread, index=rows.index)
    if not mask.any():
        return rows
    out = rows.copy()
    out.loc[mask, "extra"] = [json.dumps({**json_dict(e), "raw_gbps": split.raw_gbps}) for e in out.loc[mask, "extra"]]
    return out


def cpu_cluster(trainer: str, raw_gbps: float, cores: float = 0) -> str:
    """One host: every rank a process on it, its link and copies at the training run's raw loopback read, its
    ``cores`` (when known) bounding how many ranks' pulls progress at once."""
    world = TrainerLayout.parse(trainer).world
    return (
        f"gpu=cpu,nic=cx7-400,gpus_per_node={world},nics_per_node=1,nvlink_gbps={raw_gbps!r},"
        f"pcie_gbps={raw_gbps!r},hbm_gbps={2 * raw_gbps!r}" + (f",cores={cores:.17g}" if cores else "")
    )


def cpu_runs(rows: pd.DataFrame | None, split: CpuSplit | None = None) -> list[OwnRun]:
    """Every held-out setup's warm rows of the split's commit, one run per strategy (median seconds)."""
    split = split or cpu_split(rows)
    df = _cpu_syncs(rows)
    if split is None or df is None:
        return []
    df = df[(df["git_commit"] == split.commit) & df["extra_d"].map(lambda e: int(e.get("sync", 2)) >= 2)]
    cores = f"{split.cores:.3g}" if split.cores else "unbounded"
    out = []
    for (model, trainer, engine, strategy), g in df.groupby(["model", "trainer", "engine", "strategy"], sort=False):
        held = Setup(str(model), str(trainer), str(engine))
        if held not in split.held:
            continue
        layout, reps = split_label(held.engine)
        direct = bool(g.iloc[0]["extra_d"].get("direct", False)) and strategy in ("v2", "v3")
        host = cpu_cluster(held.trainer, split.raw_gbps, split.cores)
        spec = Spec(
            held.model, held.trainer, layout, reps, 1, 1, host, "colocated",
            "nccl" if strategy == "broadcast" else "pull", direct=direct,
        )  # fmt: skip
        layouts = (held.trainer, held.engine)
        other = "" if layouts == (split.train.trainer, split.train.engine) else "-" + "-".join(layouts).replace(" ", "")
        key = f"own-cpu-{held.model}-{strategy}{other}"
        what = f"{held.label()} {strategy}, CPU processes of one host"
        refs = tuple(row_ref(r) for _, r in g.iterrows())
        basis = (
            f"costs from the {split.training_for(held.engine).label()} rows of {split.commit[:12]} only (target cpu; "
            f"the training run with the nearest number of engine-rank processes), rates at the raw loopback read "
            f"of {split.train.label()} ({split.raw_gbps:.2f} GB/s), {cores} cores"
        )
        seconds = statistics.median(g["seconds"])
        out.append(OwnRun(key, what, seconds, refs, spec, str(strategy), TARGET, basis, pass_medians(g)))
    return out


def pass_medians(g: pd.DataFrame) -> tuple[float, ...]:
    """The median seconds of each pass of one setup's warm syncs (decorated rows in the order they ran): a pass
    starts where the sync numbers start again (``extra.sync`` not above the previous row's)."""
    syncs = g["extra_d"].map(lambda e: int(e.get("sync", 2))).tolist()
    starts = [i == 0 or n <= syncs[i - 1] for i, n in enumerate(syncs)]
    passes = pd.Series(starts, index=g.index).cumsum()
    return tuple(float(statistics.median(p["seconds"])) for _, p in g.groupby(passes, sort=False))


def cpu_checks(rows: pd.DataFrame | None, split: CpuSplit | None = None) -> list[OwnCheck]:
    """Every held-out CPU run of ``split`` (default: the newest) next to its prediction from the costs of its
    training run (:meth:`CpuSplit.training_for`)."""
    split = split or cpu_split(rows)
    if split is None:
        return []
    books: dict[Setup, CostBook] = {}
    out = []
    for run in cpu_runs(rows, split):
        train = split.training_for(f"{run.spec.engine} x{run.spec.replicas}")
        if train not in books:
            books[train] = cpu_book(rows, split, train)
        (p,) = simulate(run.spec.build(), [SIM_STRATEGIES[run.strategy]], books[train])
        out.append(OwnCheck(run, p.seconds, books[train]))
    return out


class SplitScore(NamedTuple):
    """How one recorded split's held-out CPU runs were predicted (from its own training run's costs)."""

    commit: str
    parallel_copies: float
    runs: int
    median_abs_error_pct: float
    worst_error_pct: float
    within_25: int


def split_score(split: CpuSplit, checks: list[OwnCheck]) -> SplitScore:
    """``split`` scored by its held-out runs' ``checks`` (non-empty: :func:`cpu_checks` of that split)."""
    errors = [c.error_pct for c in checks]
    median = statistics.median(abs(e) for e in errors)
    within = sum(abs(e) <= 25 for e in errors)
    return SplitScore(split.commit, split.cores, len(errors), median, max(errors, key=abs), within)


def split_scores(rows: pd.DataFrame | None) -> list[SplitScore]:
    """Every recorded split judged with today's model, oldest first, so no change is judged on the newest alone."""
    return [split_score(split, checks) for split in cpu_splits(rows) if (checks := cpu_checks(rows, split=split))]
