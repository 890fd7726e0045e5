"""Measured rows as cost samples: each row decorated with its parsed phases and extras, its device preset (a GPU,
or a CPU host at its run's own loopback rate), its setup (``kvmove.bench.sim.matching``), and a reference naming it
(commit, suite, name, setup, hardware)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pandas as pd

from kvmove.bench.results import json_dict
from kvmove.bench.sim.costs import RowRef
from kvmove.bench.sim.hardware import Gpu, cores_of_hardware, gpu_of_hardware, host_of_run, parallel_of_run
from kvmove.bench.sim.matching import TARGETS, Match, row_setup

RowFilter = Callable[[Any], bool]


class Sample(NamedTuple):
    """One row's value of a cost."""

    value: float
    ref: RowRef


Extractor = Callable[[pd.DataFrame], list[Sample]]


def decorate(rows: pd.DataFrame, matches: dict[str, Match], keep: RowFilter | None) -> pd.DataFrame:
    df = rows[rows["kind"] == "measured"].copy()
    if "timestamp" in df.columns:
        df = df.sort_values("timestamp", kind="stable")
    df["phases_d"] = df["phases"].map(json_dict)
    df["extra_d"] = df["extra"].map(json_dict)
    df["hardware"] = df["hardware"].fillna("").astype(str)
    speedups = concurrent_speedups(df)
    hosts = zip(df["hardware"], df["extra_d"], df["git_commit"], strict=True)
    df["gpu"] = [_device(h, e, speedups.get(str(c))) for h, e, c in hosts]
    for c in ("bytes", "seconds", "gbps"):
        df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0.0)
    df["setup"] = [row_setup(r) for _, r in df.iterrows()] if len(df) else []
    kept = df.apply(keep, axis=1).astype(bool) if keep is not None and len(df) else True
    for name, match in matches.items():
        df[f"ok:{name}"] = df["setup"].map(match).astype(bool) & kept if len(df) else []
    return df


def _device(hardware: str, extra: dict[str, Any], speedup: float | None = None) -> Gpu | None:
    """A row's device preset: the GPU its hardware label names, or a CPU host at the raw loopback read its run
    measured (the sync suite's ``extra.raw_gbps``) with the cores its label names, fewer where its run's concurrent
    read gained only ``speedup`` (``hardware.parallel_of_run``); None when neither is known."""
    raw = extra.get("raw_gbps")
    if gpu_of_hardware(hardware) is None and hardware.startswith("cpu:") and isinstance(raw, int | float) and raw > 0:
        return host_of_run(float(raw), parallel_of_run(cores_of_hardware(hardware), speedup))
    return gpu_of_hardware(hardware)


def concurrent_speedups(df: pd.DataFrame) -> dict[str, float]:
    """Per commit, what several processes reading at once moved in all over what one moved alone, at the same
    message size: the sync suite's ``raw T xN concurrent`` row (``extra.aggregate_gbps``) over its ``raw T`` row of
    those bytes (``kvmove.bench.syncs``). Commits without both rows are absent."""
    raw = df[(df["suite"] == "transport") & df["name"].astype(str).str.startswith("raw ")]
    out: dict[str, float] = {}
    for _, r in raw.iterrows():
        name, e = str(r["name"]), json_dict(r["extra"])
        total, pairs = e.get("aggregate_gbps"), e.get("pairs")
        if not name.endswith(" concurrent") or not isinstance(total, int | float) or not pairs:
            continue
        single_name = name.removesuffix(f" x{pairs} concurrent")
        same = (raw["git_commit"] == r["git_commit"]) & (raw["bytes"] == r["bytes"])
        alone = float(raw[same & (raw["name"] == single_name)]["gbps"].median())
        if alone > 0:
            out[str(r["git_commit"])] = float(total) / alone
    return out


def row_ref(r: Any) -> RowRef:
    """The reference a cost keeps to one decorated row."""
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


def where(df: pd.DataFrame, keep: Callable[[dict[str, Any]], bool]) -> pd.DataFrame:
    """Rows whose ``extra`` passes ``keep`` (an empty frame stays an empty frame)."""
    return df[df["extra_d"].map(keep).astype(bool)] if len(df) else df


def syncs(df: pd.DataFrame, transport: str | None = None, strategies: tuple[str, ...] = ()) -> pd.DataFrame:
    rows = df[df["gpu"].notna() & (df["strategy"].fillna("") != "")]
    rows = where(rows, lambda e: e.get("verified") is not False and int(e.get("sync", 2)) >= 2)
    if transport:
        rows = rows[rows["transport"] == transport]
    if strategies:
        rows = rows[rows["strategy"].isin(strategies)]
    return rows


def decorated(rows: pd.DataFrame) -> pd.DataFrame:
    """Measured rows with their parsed ``phases_d``/``extra_d``, GPU preset and :class:`RowSetup` (``setup``)."""
    return decorate(rows, TARGETS["cluster"], None)
