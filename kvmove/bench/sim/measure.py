"""Costs from our own measured rows (``results/*.parquet``): one extractor per cost, each naming its rows.

Every extractor looks for the rows that measure its cost, takes the newest git commit that has such rows, and
returns the median over them with a reference to each row (commit, suite, name, setup); where no row measures
a cost, the cost keeps its named default and the report flags it. Counts that turn a phase into a per-operation
cost (pulls, packed calls, yields, tensors) come from this simulator's traffic of the row's own model and
layouts, so rows of any layout are used as soon as they exist.

Rows used: the GPU suite's ceilings and syncs (``kvmove.bench.gpu``, hardware ``gpu:...``; efficiencies are
taken over the vendor figures of the GPU named there), its FP8 syncs and the delta suite on a GPU (device-local
passes: ``kvmove.bench.sim.passes``), the all-gather micro-benchmark (``kvmove.bench.micro``),
the CPU vLLM suite (per-layer reload of vLLM's post-processing, a host-side cost) and the CPU sync suite (rates over
the host's own loopback read, ``kvmove.bench.sim.hardware.host_of_run``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import pandas as pd

from kvmove.bench.runs import engine_ranks
from kvmove.bench.sim.costs import SPECS, Cost, CostBook, default_book
from kvmove.bench.sim.counts import Counts, row_counts
from kvmove.bench.sim.hardware import Gpu
from kvmove.bench.sim.matching import TARGETS
from kvmove.bench.sim.passes import delta_pass, mapped_quantize, trainer_quantize
from kvmove.bench.sim.samples import Extractor, RowFilter, Sample, decorate, row_ref, syncs, where
from kvmove.bench.sim.sender import Rates, broadcast_op, funnel_yield, raw_broadcast
from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import TrainerLayout

_MEMO: dict[tuple[int, str, str], float] = {}
_FULL: dict[str, pd.DataFrame] = {}
"""The whole decorated frame of the book being built (a run's device copy ceiling is read from it)."""


def costs_from_rows(rows: pd.DataFrame | None, target: str = "cluster", keep: RowFilter | None = None) -> CostBook:
    """The cost book for ``target`` (``kvmove.bench.sim.matching.TARGETS``): each cost from the newest commit of
    the rows whose setup its declaration for that target accepts (and ``keep``, a held-out split, passes); the
    others at their named defaults."""
    if target not in TARGETS:
        raise KvmoveError(f"unknown cost target {target!r} (known: {', '.join(TARGETS)})")
    if rows is None or rows.empty:
        return default_book()
    _MEMO.clear()
    df = decorate(rows, TARGETS[target], keep)
    _FULL["df"] = df
    known: dict[str, Cost] = {}
    for name, (kind, extract, note) in EXTRACTORS.items():
        samples = _newest(extract(_rows_for(df, name)))
        if samples:
            value = statistics.median(s.value for s in samples)
            match = TARGETS[target][name]
            known[name] = Cost(
                name, _clip(name, value), kind, tuple(s.ref for s in samples), f"{note}; rows of {match.label()}"
            )
    return default_book(known)


def _rows_for(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """The rows whose setup may measure ``name`` for the book's target."""
    return df[df[f"ok:{name}"]] if len(df) else df


def _clip(name: str, value: float) -> float:
    """Derived per-op costs can come out slightly negative from noise; efficiencies stay in (0, 1]."""
    if SPECS[name].unit == "fraction":
        return min(max(value, 1e-3), 1.0)
    return max(value, 0.0)


def _newest(samples: list[Sample]) -> list[Sample]:
    if not samples:
        return []
    order = {s.ref.commit: i for i, s in enumerate(samples)}
    newest = max(order, key=lambda c: order[c])
    return [s for s in samples if s.ref.commit == newest]


# --- ceilings: a measured rate over the vendor's line rate ------------------------------------------------------
def _ceiling(prefix: str, line: Callable[[Gpu], float]) -> Extractor:
    def extract(df: pd.DataFrame) -> list[Sample]:
        rows = df[df["name"].astype(str).str.startswith(prefix) & df["gpu"].notna()]
        return [Sample(r["gbps"] / line(r["gpu"]), row_ref(r)) for _, r in rows.iterrows() if r["gbps"] > 0]

    return extract


# --- syncs ------------------------------------------------------------------------------------------------------
def _transfer_efficiency(transport: str) -> Extractor:
    """Warm v2/v3 syncs: the transfer phase's rate over the line rate of the link used (NVLink between the
    two GPUs of one host, unless the row names another link in ``extra.link``). On a CPU host running ``cores``
    line-rate copies at once (its cores, or fewer as its run measured: ``hardware.parallel_of_run``) whose ``k``
    engine ranks pulled at once, each progressed at ``cores / k`` of its own rate (when ``k`` > cores): its own rate
    is the one measured times ``k / cores`` (the pricing's host bound, ``kvmove.bench.sim.pricing``)."""

    def extract(df: pd.DataFrame) -> list[Sample]:
        out = []
        for _, r in syncs(df, transport, ("v2", "v3")).iterrows():
            rate = float(r["extra_d"].get("transfer_gbps", 0.0)) * _sharing(r)
            line = _line_gbps(r)
            if rate > 0 and line > 0:
                out.append(Sample(rate / line, row_ref(r)))
        return out

    return extract


def _sharing(r: Any) -> float:
    """How many engine ranks shared each of a CPU host's line-rate copies while pulling (1 on a GPU, or with cores
    to spare)."""
    cores = r["gpu"].cores
    return max(1.0, engine_ranks(str(r["engine"])) / cores) if cores else 1.0


def _line_gbps(r: Any) -> float:
    """The line rate of the link a sync row's transfer used: a device copy (HBM / 2) when trainer and engine
    share the GPU, NVLink between two GPUs (unless the row names another link in ``extra.link``)."""
    if r["setup"].path == "gpu-copy":
        return float(r["gpu"].hbm_gbps) / 2
    return float(r["gpu"].nvlink_gbps) if r["extra_d"].get("link", "nvlink") == "nvlink" else 0.0


def _copy_rate(df: pd.DataFrame, commit: str, gpu: Gpu) -> float:
    """Bytes/s a device copy moves in the run of ``commit`` (its ceiling row), else the vendor's HBM / 2."""
    df = _FULL.get("df", df)
    key = (id(df), "copy", f"{commit} {gpu.name}")
    if key not in _MEMO:
        rows = df[(df["git_commit"] == commit) & df["name"].astype(str).str.startswith("ceiling device copy")]
        _MEMO[key] = float(rows["gbps"].median()) * 1e9 / 2 if len(rows) else gpu.hbm_gbps * 1e9 / 2
    return _MEMO[key]


def _phase_rate(phase: str) -> Extractor:
    """Packed warm v2/v3 syncs: bytes over the phase's seconds, over the same run's device copy rate."""

    def extract(df: pd.DataFrame) -> list[Sample]:
        out = []
        rows = syncs(df, None, ("v2", "v3"))
        for _, r in where(rows, lambda e: not e.get("direct")).iterrows():
            seconds = float(r["phases_d"].get(phase, 0.0))
            if seconds > 0:
                rate = r["bytes"] / seconds
                out.append(Sample(rate / _copy_rate(df, r["git_commit"], r["gpu"]), row_ref(r)))
        return out

    return extract


def _per_op(
    phase: str,
    count: Callable[[Counts], float],
    minus: Callable[[Any, pd.DataFrame], float],
    only: Callable[[Any], bool] = lambda r: True,
) -> Extractor:
    """v1 syncs (one pull per tensor): (phase seconds - its bytes term) / operations, operations counted in the
    row's own traffic."""

    def extract(df: pd.DataFrame) -> list[Sample]:
        out = []
        for _, r in syncs(df, None, ("v1",)).iterrows():
            if not only(r):
                continue
            counts = row_counts(r)
            seconds = float(r["phases_d"].get(phase, 0.0))
            if counts is None or seconds <= 0 or count(counts) <= 0:
                continue
            out.append(Sample((seconds - minus(r, df)) / count(counts), row_ref(r)))
        return out

    return extract


def _bytes_at(efficiency: str) -> Callable[[Any, pd.DataFrame], float]:
    def minus(r: Any, df: pd.DataFrame) -> float:
        return float(r["bytes"]) / (_copy_rate(df, r["git_commit"], r["gpu"]) * _median(df, efficiency))

    return minus


def _transfer_bytes(r: Any, df: pd.DataFrame) -> float:
    """A v1 row's transfer phase for its bytes alone, as the pricing's link takes them: the busiest engine rank's
    bytes (on a CPU host of ``cores`` cores, at least all ranks' bytes / cores) at the measured transfer rate."""
    efficiency = "pull_efficiency" if r["transport"] == "nixl" else "ipc_efficiency"
    counts = row_counts(r)
    moved = counts.kept if counts is not None and counts.kept > 0 else float(r["bytes"])
    if r["gpu"].cores:
        moved = max(moved, float(r["bytes"]) / r["gpu"].cores)
    return moved / (_line_gbps(r) * 1e9 * _median(df, efficiency))


def _median(df: pd.DataFrame, name: str) -> float:
    """The value ``name``'s extractor gives on the book's rows for it (without rows: its named default, or 1.0 for
    an efficiency that defaults to another cost), computed once per book."""
    df = _FULL.get("df", df)
    key = (id(df), "median", name)
    if key not in _MEMO:
        samples = _newest(EXTRACTORS[name][1](_rows_for(df, name)))
        default = SPECS[name].default
        fallback = float(default) if not isinstance(default, str) else 1.0
        _MEMO[key] = statistics.median(s.value for s in samples) if samples else fallback
    return _MEMO[key]


def _no_bytes(r: Any, df: pd.DataFrame) -> float:
    return 0.0


def _trainer_work(r: Any, df: pd.DataFrame) -> float:
    """An engine rank's request phase is its wait for the reply, which spans the trainer gathering and packing the
    pull on demand (``kvmove.sync.ranks.engine``: ``request`` times ``client.wait``): priced as gather and pack."""
    return float(r["phases_d"].get("gather", 0.0)) + float(r["phases_d"].get("pack", 0.0))


def _single_trainer_rank(r: Any) -> bool:
    """A one-rank trainer gathers nothing: its gather phase is only yielding tensors from the source."""
    try:
        return TrainerLayout.parse(str(r["trainer"])).world == 1
    except KvmoveError:
        return False


def _sync_fixed(df: pd.DataFrame) -> list[Sample]:
    """Direct v2/v3 syncs (nothing runs but the engines' reads): seconds - transfer phase."""
    rows = where(syncs(df, None, ("v2", "v3")), lambda e: bool(e.get("direct")))
    return [
        Sample(float(r["seconds"]) - float(r["phases_d"].get("transfer", 0.0)), row_ref(r))
        for _, r in rows.iterrows()
        if float(r["phases_d"].get("transfer", 0.0)) > 0
    ]


def _cold(df: pd.DataFrame) -> list[Sample]:
    """First sync of a run minus the median of its later ones, per byte one engine rank keeps."""
    rows = df[df["gpu"].notna() & (df["strategy"].fillna("") != "")]
    out = []
    keys = ["git_commit", "transport", "strategy", "model", "trainer", "engine"]
    for _, group in rows.groupby(keys, sort=False):
        first = where(group, lambda e: int(e.get("sync", 0)) == 1)
        later = where(group, lambda e: int(e.get("sync", 0)) >= 2)
        counts = row_counts(first.iloc[0]) if len(first) else None
        if len(first) and len(later) and counts is not None and counts.kept > 0:
            extra = float(first.iloc[0]["seconds"]) - float(later["seconds"].median())
            out.append(Sample(extra / counts.kept, row_ref(first.iloc[0])))
    return out


def _micro(name: str, value: Callable[[Any], float]) -> Extractor:
    def extract(df: pd.DataFrame) -> list[Sample]:
        rows = df[(df["name"] == name) & df["gpu"].notna()]
        return [Sample(value(r), row_ref(r)) for _, r in rows.iterrows() if r["seconds"] > 0]

    return extract


def _collectives(df: pd.DataFrame) -> list[Sample]:
    """The all-gather micro-benchmark (GPUs); v1 syncs whose trainer ranks gather every tensor (a CPU host's gloo
    collectives): (gather phase - yields x materialize_s - gathered bytes at the link's NCCL rate) / collectives."""
    out = _micro("nccl all_gather 4 KiB", lambda r: float(r["seconds"]))(df)
    for _, r in syncs(df, None, ("v1",)).iterrows():
        counts = row_counts(r)
        seconds = float(r["phases_d"].get("gather", 0.0))
        if counts is None or counts.gathers <= 0 or seconds <= 0:
            continue
        rate = _line_gbps(r) * 1e9 * _median(df, "nccl_efficiency")
        seconds -= counts.yields * _median(df, "materialize_s") + counts.gathered / rate
        out.append(Sample(seconds / counts.gathers, row_ref(r)))
    return out


def _reload(df: pd.DataFrame) -> list[Sample]:
    """vLLM suite (CPU): a vLLM engine's load phase minus the reference engine's, same commit and setup, per
    decoder layer an engine rank reloads (vLLM's post-processing of each layer; host-side work)."""
    rows = df[(df["suite"] == "vllm") & (df["strategy"].fillna("") != "")]
    out = []
    for _, group in rows.groupby(["git_commit", "model", "trainer", "engine", "strategy"], sort=False):
        kinds = group["extra_d"].map(lambda e: e.get("engine_kind", "reference"))
        vllm, ref = group[kinds == "vllm"], group[kinds == "reference"]
        layers = _layers(str(group.iloc[0]["model"]))
        if len(vllm) and len(ref) and layers:
            load = [float(p.get("load", 0.0)) for p in vllm["phases_d"]]
            base = [float(p.get("load", 0.0)) for p in ref["phases_d"]]
            value = (statistics.median(load) - statistics.median(base)) / layers
            out += [Sample(value, row_ref(r)) for _, r in vllm.iterrows()]
    return out


def _layers(model: str) -> int:
    try:
        return resolve_model(model).num_hidden_layers
    except KvmoveError:
        return 0


_RATES = Rates(_line_gbps, _median, _clip)

EXTRACTORS: dict[str, tuple[str, Extractor, str]] = {
    "copy_efficiency": ("measured", _ceiling("ceiling device copy", lambda g: g.hbm_gbps), "device copy ceiling"),
    "p2p_efficiency": ("measured", _ceiling("ceiling p2p copy", lambda g: g.nvlink_gbps), "peer copy ceiling"),
    "nccl_efficiency": (
        "measured",
        lambda df: _ceiling("ceiling nccl send/recv", lambda g: g.nvlink_gbps)(df) + raw_broadcast(df),
        "NCCL send/recv ceiling over NVLink; CPU: the bytes per second per round of the broadcast's root sends (the "
        "line through its own sends, or the run's raw gloo broadcast to its engine group), over the raw loopback read",
    ),
    "h2d_efficiency": ("measured", _ceiling("ceiling pinned", lambda g: g.pcie_gbps), "pinned H2D and D2H"),
    "pull_efficiency": (
        "measured",
        _transfer_efficiency("nixl"),
        "NIXL READ during warm v2/v3 syncs, over NVLink: no NIC measurement of ours yet, applied to NICs as is",
    ),
    "ipc_efficiency": ("measured", _transfer_efficiency("cuda-ipc"), "CUDA-IPC reads during warm v2/v3 syncs"),
    "pack_efficiency": ("measured", _phase_rate("pack"), "packed v2/v3 syncs: bytes / pack phase / device copy rate"),
    "load_efficiency": ("measured", _phase_rate("load"), "packed v2/v3 syncs: bytes / load phase / device copy rate"),
    "request_s": (
        "derived",
        _per_op("request", lambda c: c.pulls, _trainer_work),
        "v1: (request phase - the gather and pack it waits for on the trainer) / pulls",
    ),
    "materialize_s": (
        "derived",
        lambda df: (
            _per_op("gather", lambda c: c.yields, _no_bytes, _single_trainer_rank)(df) + funnel_yield(df, _RATES)
        ),
        "v1 with a tp=1 trainer (no collective): gather phase / tensors yielded; kvmove's broadcast with several "
        "trainer ranks: (seconds - driver - rank 0's broadcast calls - load - the gather's collectives and bytes) "
        "/ tensors",
    ),
    "pack_call_s": (
        "derived",
        _per_op("pack", lambda c: c.calls, _bytes_at("pack_efficiency")),
        "v1: (pack phase - bytes at the packing rate) / pulls served",
    ),
    "load_call_s": (
        "derived",
        _per_op("load", lambda c: c.pulls, _bytes_at("load_efficiency")),
        "v1: (load phase - bytes at the load rate) / pulls",
    ),
    "pull_op_s": (
        "derived",
        _per_op("transfer", lambda c: c.pulls, _transfer_bytes),
        "v1: (transfer phase - bytes at the measured transfer efficiency) / pulls",
    ),
    "broadcast_op_s": (
        "derived",
        lambda df: broadcast_op(df, _RATES),
        "broadcast: the fixed term of the line through rank 0's sends, or (its time in its sends - the bytes it "
        "sends at the broadcast rate), per step",
    ),
    "cold_s_per_byte": ("derived", _cold, "first sync minus later ones, per byte an engine rank keeps"),
    "sync_s": ("derived", _sync_fixed, "direct v2/v3 syncs: seconds - transfer phase"),
    "reload_layer_s": ("derived", _reload, "vLLM (CPU) load phase minus the reference engine's, per layer"),
    "quantize_efficiency": (
        "derived",
        lambda df: trainer_quantize(df, _RATES) + mapped_quantize(df, _RATES),
        "FP8 syncs: BF16 bytes the trainer quantized x 1.5 (read 2 B, write 1 B) / (pack phase - its per-pull "
        "calls) / HBM bandwidth; one GPU, mapped pulls: BF16 bytes the engine quantized x 1.5 / (seconds - the "
        "sync's fixed cost) / HBM bandwidth",
    ),
    "delta_detect_efficiency": (
        "measured",
        delta_pass("detect_encode", ""),
        "delta suite: model bytes / detection + encoding phase / the same run's device copy rate",
    ),
    "delta_apply_efficiency": (
        "measured",
        delta_pass("apply", "dense_land"),
        "delta suite: model bytes / (apply phase - the dense landing) / the same run's device copy rate",
    ),
    "collective_s": (
        "measured",
        _collectives,
        "micro-benchmark: one small NCCL all-gather between the two GPUs; CPU: v1's gather phase per collective",
    ),
}
