"""The GPU suite's FP8 part (``kvmove bench run --suite gpu-fp8``): one BF16 trainer synced into a BF16 engine
and into an FP8 engine (e4m3 weights, 128x128 block scales), v3, the same transport, devices and model slice, in
the same run; every sync verified bit-exact.

The FP8 engine's regions are quantized inside the sync (kvmove.sync.planning.entries): on the trainer, before the
bytes leave, where it holds whole blocks (the trainer's ``pack`` quantizes every cover of a pull in batched calls
of kvmove.quant, Triton on CUDA), else on the engine once a cover's BF16 pieces landed. On one GPU with cuda-ipc
(a mapped peer view: the engine process opens the trainer's arena), the engine quantizes those covers itself,
straight from the arena into its parameters (mapped pulls: no slot, no read, no landing copy); its rows' copy
executor bytes then name them ``mapped-quantize``. Each FP8 row carries what crossed the link by transform and its
bytes and time relative to the BF16 rows of the same run.

Works on two GPUs (trainer on ``devices[0]``, engine on ``devices[1]``) or one (both on ``cuda:0``: the cuda-ipc
pull transport maps the trainer's slots and arena into the engine process on the same device; nccl cannot, so it
is skipped there). On CPU devices the same code is its own CI twin.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import torch

from kvmove.bench.gpu import GpuSuite, Record, Say
from kvmove.bench.results import Row, link_conditions
from kvmove.errors import JobFailed, KvmoveError
from kvmove.models.config import ModelConfig

FP8_STRATEGY = "v3"


def fp8_devices() -> tuple[str, str]:
    """Two GPUs when there are, else both sides on ``cuda:0``."""
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")


def gpu_fp8_suite(suite: GpuSuite, record: Record, say: Say) -> list[Row]:
    """Ceilings between ``suite.devices`` (the FP8 rows' link limit), then :func:`fp8_syncs`."""
    from kvmove.bench.gpu import ceilings

    if suite.cuda and torch.cuda.device_count() < 1:
        raise KvmoveError("the gpu-fp8 suite needs a CUDA GPU (its CPU twin: GpuSuite.cpu_twin() on cpu devices)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
    rows = ceilings(suite, say)
    record(rows)
    p2p = next((r.gbps for r in rows if r.name.startswith("ceiling p2p")), 0.0)
    if not p2p:  # one GPU: the bytes never leave it, the device copy (half its read+write rate) is the limit
        p2p = next((r.gbps / 2 for r in rows if r.name.startswith("ceiling device copy")), 0.0)
    return rows + fp8_syncs(suite, p2p, record, say)


def fp8_syncs(suite: GpuSuite, p2p_gbps: float, record: Record, say: Say) -> list[Row]:
    """BF16 then FP8 engine, ``suite.syncs`` verified v3 syncs each, on the first of ``suite.transports`` that
    runs here; FP8 rows carry their ratios to the BF16 ones. ``p2p_gbps``: the link's rate (on one GPU, its
    device-copy rate: the bytes never leave it)."""
    from kvmove.models import model_totals, resolve_model
    from kvmove.models.checkpoint import with_engine_dtype
    from kvmove.transport import TRANSPORTS

    shared = suite.devices[0] == suite.devices[1]
    usable = [t for t in suite.transports if t in TRANSPORTS and TRANSPORTS[t].is_available()]
    usable = [t for t in usable if not (shared and t == "nccl")]  # NCCL refuses two ranks on one device
    if not usable:
        raise KvmoveError(f"no pull transport of {', '.join(suite.transports)} runs here for the fp8 syncs")
    transport = usable[0]
    cfg = resolve_model(suite.model, {"num_hidden_layers": suite.layers})
    gb = model_totals(cfg).total_bytes / 1e9
    say(f"fp8 sync: {cfg.name} with {suite.layers} layers, {gb:.1f} GB BF16, {transport}")
    bf16 = _runs(suite, with_engine_dtype(cfg, "bf16"), transport, p2p_gbps, say)
    record(bf16)
    fp8 = _runs(suite, with_engine_dtype(cfg, "fp8"), transport, p2p_gbps, say)
    fp8 = [_against(r, bf16) for r in fp8]
    record(fp8)
    return bf16 + fp8


def _runs(suite: GpuSuite, cfg: ModelConfig, transport: str, p2p_gbps: float, say: Say) -> list[Row]:
    from kvmove.bench.syncs import sync_row
    from kvmove.models.layout import EngineLayout, TrainerLayout
    from kvmove.sync.config import Placement, SyncConfig
    from kvmove.sync.driver.dryrun import dry_run_sync
    from kvmove.sync.driver.run import run_syncs
    from kvmove.sync.strategies import parse_strategies

    config = SyncConfig(
        model=cfg,
        trainer=TrainerLayout(),
        engine=EngineLayout(),
        strategies=tuple(parse_strategies(FP8_STRATEGY)),
        transport=transport,
        syncs=suite.syncs,
        verify=True,
        placement=Placement("processes", (suite.devices[0],), (suite.devices[1],)),
        deadline_s=suite.deadline_s,
    )
    (plan,) = dry_run_sync(dataclasses.replace(config, verify=False))  # the plan only: the syncs verify
    rows, link = [], link_conditions()
    try:
        for r in run_syncs(config, progress=say):
            say(f"  {cfg.engine_dtype} {r.strategy} sync {r.sync}: {r.seconds:.4f} s, {r.bytes / 1e9:.2f} GB, "
                f"{r.gbps:.1f} GB/s, verified={r.verified}")  # fmt: skip
            extra: dict[str, object] = {
                "p2p_gbps": p2p_gbps,
                "fraction_of_p2p": r.gbps / p2p_gbps if p2p_gbps else None,
                "model_overrides": {"num_hidden_layers": suite.layers},
                "bytes_by_transform": plan.bytes_by_transform,
                "planned_bytes": plan.bytes_total,
            }
            row = sync_row(config, r, suite="gpu", extra=extra, link=link)
            name = f"fp8 sync {r.strategy} {cfg.engine_dtype}"
            rows.append(dataclasses.replace(row, name=name, link_limit_gbps=p2p_gbps or row.link_limit_gbps))
    except (KvmoveError, JobFailed) as exc:  # the BF16 rows of the run must survive a failed FP8 one
        say(f"  {cfg.engine_dtype} {FP8_STRATEGY} FAILED: {exc}")
    return rows


def _against(row: Row, bf16: list[Row]) -> Row:
    """``row`` with its bytes and time over the BF16 engine's (median over the BF16 syncs of the same run)."""
    if not bf16:
        return row
    base_bytes = statistics.median(r.bytes for r in bf16)
    base_seconds = statistics.median(r.seconds for r in bf16)
    ratios = {
        "bf16_bytes": base_bytes,
        "bf16_seconds": base_seconds,
        "bytes_vs_bf16": row.bytes / base_bytes,
        "time_vs_bf16": row.seconds / base_seconds,
    }
    return dataclasses.replace(row, extra={**row.extra, **ratios})
