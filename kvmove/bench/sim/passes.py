"""Costs of the device-local passes a sync runs, from its rows: FP8 block quantization (the trainer's pack into
slots, or one GPU's engine quantizing from the trainer's mapped arena) and a delta sync's detection and apply.

Extractors of ``kvmove.bench.sim.measure`` (its ``EXTRACTORS`` name them); they read the book being built through
that module's :class:`~kvmove.bench.sim.sender.Rates`, so a cost they subtract is the one the book holds.
"""

from __future__ import annotations

import pandas as pd

from kvmove.bench.sim.costs import QUANTIZE_TRAFFIC
from kvmove.bench.sim.counts import mapped_bf16, row_counts
from kvmove.bench.sim.samples import Extractor, Sample, row_ref, syncs, where
from kvmove.bench.sim.sender import Rates


def trainer_quantize(df: pd.DataFrame, m: Rates) -> list[Sample]:
    """Warm FP8 v2/v3 syncs whose trainer quantizes: its pack phase is the batched quantize programs writing FP8
    and scales into the slots (plus one call per pull served)."""
    out = []
    for _, r in syncs(df, None, ("v2", "v3")).iterrows():
        counts = row_counts(r)
        seconds = float(r["phases_d"].get("pack", 0.0))
        if counts is None or counts.quant <= 0 or seconds <= 0:
            continue
        seconds -= counts.calls * m.median(df, "pack_call_s")
        if seconds > 0:
            out.append(Sample(QUANTIZE_TRAFFIC * counts.quant / seconds / (r["gpu"].hbm_gbps * 1e9), row_ref(r)))
    return out


def mapped_quantize(df: pd.DataFrame, m: Rates) -> list[Sample]:
    """Warm FP8 v3 syncs on one GPU whose engine quantized covers itself from the trainer's mapped arena (their copy
    executors name ``mapped-quantize`` bytes): those programs run on a stream of their own from the sync's start and
    bound it, so BF16 bytes quantized x 1.5 / (seconds - the sync's fixed cost) / HBM bandwidth."""
    out = []
    rows = where(syncs(df, None, ("v3",)), lambda e: (e.get("copy_executor_bytes") or {}).get("mapped-quantize", 0))
    for _, r in rows.iterrows():
        seconds = float(r["seconds"]) - m.median(df, "sync_s")
        bf16 = mapped_bf16(r)
        if seconds > 0 and bf16 > 0:
            out.append(Sample(QUANTIZE_TRAFFIC * bf16 / seconds / (r["gpu"].hbm_gbps * 1e9), row_ref(r)))
    return out


def delta_pass(phase: str, minus: str) -> Extractor:
    """Delta suite rows on a GPU: model bytes over (phase - ``minus`` phase) over the run's device copy rate
    (``device_copy_gbps`` counts reads and writes: a copy moves half of it)."""

    def extract(df: pd.DataFrame) -> list[Sample]:
        out = []
        for _, r in df[df["suite"] == "delta"].iterrows() if len(df) else ():
            e, p = r["extra_d"], r["phases_d"]
            seconds = float(p.get(phase, 0.0)) - float(p.get(minus, 0.0) if minus else 0.0)
            copy = float(e.get("device_copy_gbps") or 0.0) * 1e9 / 2
            if seconds > 0 and copy > 0 and e.get("model_bytes"):
                out.append(Sample(float(e["model_bytes"]) / seconds / copy, row_ref(r)))
        return out

    return extract
