"""Costs from our own measured rows (``results/*.parquet``): one extractor per cost, each naming its rows.

Every extractor looks for the rows that measure its cost, takes the newest git commit that has such rows, and
returns the median over them with a reference to each row (commit, suite, name, setup); where no row measures
a cost, the cost keeps its named default and the report flags it. Counts that turn a phase into a per-operation
cost (pulls, packed calls, yields, tensors) come from this simulator's traffic of the row's own model and
layouts, so rows of any layout are used as soon as they exist.

Rows used: the GPU suite's ceilings and syncs (``kvmove.bench.gpu``, hardware ``gpu:...``; efficiencies are
taken over the vendor figures of the GPU named there), its micro-benchmarks (``kvmove.bench.micro``) and the CPU
vLLM suite (per-layer reload of vLLM's post-processing, a host-side cost).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

import pandas as pd

from kvmove.bench.sim.costs import Cost, CostBook, RowRef, default_book
from kvmove.bench.sim.counts import Counts, row_counts
from kvmove.bench.sim.hardware import Gpu, gpu_of_hardware
from kvmove.bench.sim.matching import TARGETS, Match, row_setup
from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import TrainerLayout


class Sample(NamedTuple):
    """One row's value of a cost."""

    value: float
    ref: RowRef


Extractor = Callable[[pd.DataFrame], list[Sample]]


_MEMO: dict[tuple[int, str, str], float] = {}
_FULL: dict[str, pd.DataFrame] = {}
"""The whole decorated frame of the book being built (a run's device copy ceiling is read from it)."""

RowFilter = Callable[[Any], bool]


def costs_from_rows(rows: pd.DataFrame | None, target: str = "cluster", keep: RowFilter | None = None) -> CostBook:
    """The cost book for ``target`` (``kvmove.bench.sim.matching.TARGETS``): each cost from the newest commit of
    the rows whose setup its declaration for that target accepts (and ``keep``, a held-out split, passes); the
    others at their named defaults."""
    if target not in TARGETS:
        raise KvmoveError(f"unknown cost target {target!r} (known: {', '.join(TARGETS)})")
    if rows is None or rows.empty:
        return default_book()
    _MEMO.clear()
    df = _decorate(rows, TARGETS[target], keep)
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
    from kvmove.bench.sim.costs import SPECS

    if SPECS[name].unit == "fraction":
        return min(max(value, 1e-3), 1.0)
    return max(value, 0.0)


def _newest(samples: list[Sample]) -> list[Sample]:
    if not samples:
        return []
    order = {s.ref.commit: i for i, s in enumerate(samples)}
    newest = max(order, key=lambda c: order[c])
    return [s for s in samples if s.ref.commit == newest]


def _decorate(rows: pd.DataFrame, matches: dict[str, Match], keep: RowFilter | None) -> pd.DataFrame:
    df = rows[rows["kind"] == "measured"].copy()
    if "timestamp" in df.columns:
        df = df.sort_values("timestamp", kind="stable")
    df["phases_d"] = df["phases"].map(_json)
    df["extra_d"] = df["extra"].map(_json)
    df["hardware"] = df["hardware"].fillna("").astype(str)
    df["gpu"] = df["hardware"].map(gpu_of_hardware)
    for c in ("bytes", "seconds", "gbps"):
        df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0.0)
    df["setup"] = [row_setup(r) for _, r in df.iterrows()] if len(df) else []
    kept = df.apply(keep, axis=1).astype(bool) if keep is not None and len(df) else True
    for name, match in matches.items():
        df[f"ok:{name}"] = df["setup"].map(match).astype(bool) & kept if len(df) else []
    return df


def _json(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value) if isinstance(value, str) else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _ref(r: Any) -> RowRef:
    e = r["extra_d"]
    setup = " ".join(
        str(x)
        for x in (r.get("model", ""), r.get("trainer", ""), "->", r.get("engine", ""), r.get("strategy", ""))
        if x
    )
    setup += f" {r.get('transport', '')}".rstrip()
    if "setup" in r:
        setup += f" {r['setup'].placement} x{r['setup'].gpus}"
    if "direct" in e:
        setup += " direct" if e["direct"] else " packed"
    if "sync" in e:
        setup += f" sync {e['sync']}"
    return RowRef(str(r["git_commit"]), str(r["suite"]), str(r["name"]), setup.strip(), str(r["hardware"]))


# --- ceilings: a measured rate over the vendor's line rate ------------------------------------------------------
def _ceiling(prefix: str, line: Callable[[Gpu], float]) -> Extractor:
    def extract(df: pd.DataFrame) -> list[Sample]:
        rows = df[df["name"].astype(str).str.startswith(prefix) & df["gpu"].notna()]
        return [Sample(r["gbps"] / line(r["gpu"]), _ref(r)) for _, r in rows.iterrows() if r["gbps"] > 0]

    return extract


def _where(df: pd.DataFrame, keep: Callable[[dict[str, Any]], bool]) -> pd.DataFrame:
    """Rows whose ``extra`` passes ``keep`` (an empty frame stays an empty frame)."""
    return df[df["extra_d"].map(keep).astype(bool)] if len(df) else df


# --- syncs ------------------------------------------------------------------------------------------------------
def _syncs(df: pd.DataFrame, transport: str | None = None, strategies: tuple[str, ...] = ()) -> pd.DataFrame:
    rows = df[df["gpu"].notna() & (df["strategy"].fillna("") != "")]
    rows = _where(rows, lambda e: e.get("verified") is not False and int(e.get("sync", 2)) >= 2)
    if transport:
        rows = rows[rows["transport"] == transport]
    if strategies:
        rows = rows[rows["strategy"].isin(strategies)]
    return rows


def _transfer_efficiency(transport: str) -> Extractor:
    """Warm v2/v3 syncs: the transfer phase's rate over the line rate of the link used (NVLink between the
    two GPUs of one host, unless the row names another link in ``extra.link``)."""

    def extract(df: pd.DataFrame) -> list[Sample]:
        out = []
        for _, r in _syncs(df, transport, ("v2", "v3")).iterrows():
            rate = float(r["extra_d"].get("transfer_gbps", 0.0))
            line = _line_gbps(r)
            if rate > 0 and line > 0:
                out.append(Sample(rate / line, _ref(r)))
        return out

    return extract


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
        rows = _syncs(df, None, ("v2", "v3"))
        for _, r in _where(rows, lambda e: not e.get("direct")).iterrows():
            seconds = float(r["phases_d"].get(phase, 0.0))
            if seconds > 0:
                rate = r["bytes"] / seconds
                out.append(Sample(rate / _copy_rate(df, r["git_commit"], r["gpu"]), _ref(r)))
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
        for _, r in _syncs(df, None, ("v1",)).iterrows():
            if not only(r):
                continue
            counts = row_counts(r)
            seconds = float(r["phases_d"].get(phase, 0.0))
            if counts is None or seconds <= 0 or count(counts) <= 0:
                continue
            out.append(Sample((seconds - minus(r, df)) / count(counts), _ref(r)))
        return out

    return extract


def _bytes_at(efficiency: str) -> Callable[[Any, pd.DataFrame], float]:
    def minus(r: Any, df: pd.DataFrame) -> float:
        return float(r["bytes"]) / (_copy_rate(df, r["git_commit"], r["gpu"]) * _median(df, efficiency))

    return minus


def _transfer_bytes(r: Any, df: pd.DataFrame) -> float:
    efficiency = "pull_efficiency" if r["transport"] == "nixl" else "ipc_efficiency"
    return float(r["bytes"]) / (_line_gbps(r) * 1e9 * _median(df, efficiency))


def _median(df: pd.DataFrame, name: str) -> float:
    """The value ``name``'s extractor gives on the book's rows for it (1.0 without rows), computed once per book."""
    df = _FULL.get("df", df)
    key = (id(df), "median", name)
    if key not in _MEMO:
        samples = _newest(EXTRACTORS[name][1](_rows_for(df, name)))
        _MEMO[key] = statistics.median(s.value for s in samples) if samples else 1.0
    return _MEMO[key]


def _no_bytes(r: Any, df: pd.DataFrame) -> float:
    return 0.0


def _single_trainer_rank(r: Any) -> bool:
    """A one-rank trainer gathers nothing: its gather phase is only yielding tensors from the source."""
    try:
        return TrainerLayout.parse(str(r["trainer"])).world == 1
    except KvmoveError:
        return False


def _broadcast_op(df: pd.DataFrame) -> list[Sample]:
    """NCCL broadcast syncs: (transfer phase - bytes at the measured NCCL rate) / tensors broadcast."""
    out = []
    for _, r in _syncs(df, None, ("broadcast",)).iterrows():
        counts = row_counts(r)
        transfer = float(r["phases_d"].get("transfer", 0.0))
        if counts is None or transfer <= 0:
            continue
        rate = _line_gbps(r) * 1e9 * _median(df, "nccl_efficiency")
        out.append(Sample((transfer - r["bytes"] / rate) / counts.tensors, _ref(r)))
    return out


def _cold(df: pd.DataFrame) -> list[Sample]:
    """First sync of a run minus the median of its later ones, per byte one engine rank keeps."""
    rows = df[df["gpu"].notna() & (df["strategy"].fillna("") != "")]
    out = []
    keys = ["git_commit", "transport", "strategy", "model", "trainer", "engine"]
    for _, group in rows.groupby(keys, sort=False):
        first = _where(group, lambda e: int(e.get("sync", 0)) == 1)
        later = _where(group, lambda e: int(e.get("sync", 0)) >= 2)
        counts = row_counts(first.iloc[0]) if len(first) else None
        if len(first) and len(later) and counts is not None and counts.kept > 0:
            extra = float(first.iloc[0]["seconds"]) - float(later["seconds"].median())
            out.append(Sample(extra / counts.kept, _ref(first.iloc[0])))
    return out


def _micro(name: str, value: Callable[[Any], float]) -> Extractor:
    def extract(df: pd.DataFrame) -> list[Sample]:
        rows = df[(df["name"] == name) & df["gpu"].notna()]
        return [Sample(value(r), _ref(r)) for _, r in rows.iterrows() if r["seconds"] > 0]

    return extract


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
            out += [Sample(value, _ref(r)) for _, r in vllm.iterrows()]
    return out


def _layers(model: str) -> int:
    try:
        return resolve_model(model).num_hidden_layers
    except KvmoveError:
        return 0


EXTRACTORS: dict[str, tuple[str, Extractor, str]] = {
    "copy_efficiency": ("measured", _ceiling("ceiling device copy", lambda g: g.hbm_gbps), "device copy ceiling"),
    "p2p_efficiency": ("measured", _ceiling("ceiling p2p copy", lambda g: g.nvlink_gbps), "peer copy ceiling"),
    "nccl_efficiency": ("measured", _ceiling("ceiling nccl send/recv", lambda g: g.nvlink_gbps), "NCCL send/recv"),
    "h2d_efficiency": ("measured", _ceiling("ceiling pinned", lambda g: g.pcie_gbps), "pinned H2D and D2H"),
    "pull_efficiency": (
        "measured",
        _transfer_efficiency("nixl"),
        "NIXL READ during warm v2/v3 syncs, over NVLink: no NIC measurement of ours yet, applied to NICs as is",
    ),
    "ipc_efficiency": ("measured", _transfer_efficiency("cuda-ipc"), "CUDA-IPC reads during warm v2/v3 syncs"),
    "pack_efficiency": ("measured", _phase_rate("pack"), "packed v2/v3 syncs: bytes / pack phase / device copy rate"),
    "load_efficiency": ("measured", _phase_rate("load"), "packed v2/v3 syncs: bytes / load phase / device copy rate"),
    "request_s": ("derived", _per_op("request", lambda c: c.pulls, _no_bytes), "v1: request phase / pulls"),
    "materialize_s": (
        "derived",
        _per_op("gather", lambda c: c.yields, _no_bytes, _single_trainer_rank),
        "v1 with a tp=1 trainer (no collective): gather phase / tensors yielded",
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
    "broadcast_op_s": ("derived", _broadcast_op, "broadcast: (transfer phase - bytes at NCCL's rate) / tensors"),
    "cold_s_per_byte": ("derived", _cold, "first sync minus later ones, per byte an engine rank keeps"),
    "reload_layer_s": ("derived", _reload, "vLLM (CPU) load phase minus the reference engine's, per layer"),
    "quantize_efficiency": (
        "measured",
        _micro("fp8 block quantize", lambda r: r["gbps"] / r["gpu"].hbm_gbps),
        "micro-benchmark: FP8 128x128 block quantization (read+write bytes) over HBM bandwidth",
    ),
    "collective_s": (
        "measured",
        _micro("nccl all_gather 4 KiB", lambda r: float(r["seconds"])),
        "micro-benchmark: one small NCCL all-gather between the two GPUs",
    ),
}


def decorated(rows: pd.DataFrame) -> pd.DataFrame:
    """Measured rows with their parsed ``phases_d``/``extra_d``, GPU preset and :class:`RowSetup` (``setup``)."""
    return _decorate(rows, TARGETS["cluster"], None)
