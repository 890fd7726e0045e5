"""Sync benchmark: the demo model's syncs per strategy next to the raw transport bandwidth of the same run.

The raw bandwidth is measured between two Ray actors (the same kind of process as trainer and engine ranks)
with the same transport, at the size of the largest pull and at 64 MiB, so every sync figure is a ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

from kvmove.bench.results import Row, link_conditions
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import SyncConfig
from kvmove.sync.driver.checks import check_transport
from kvmove.sync.driver.result import SyncResult
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.launchers.ray import start_ray
from kvmove.sync.strategies import STRATEGIES, parse_strategies
from kvmove.transport import get_transport

RAW_SIZES = (1 << 20, 16 << 20, 64 << 20)


def sync_row(
    config: SyncConfig,
    r: SyncResult,
    suite: str = "sync",
    extra: dict[str, object] | None = None,
    link: dict[str, str] | None = None,
) -> Row:
    """One measured row per (strategy, sync), the same for every launcher and suite; ``link_limit_gbps`` is the
    run's copy ceiling between a trainer's and an engine's device, measured at init. ``link``: the run's
    :func:`~kvmove.bench.results.link_conditions`, read once per run by callers that write several rows (read
    here otherwise)."""
    return Row(
        kind="measured",
        suite=suite,
        name=f"sync {r.strategy}",
        model=config.model.name,
        trainer=config.trainer.label(),
        engine=config.engine.label(),
        strategy=r.strategy,
        transport=r.transport,
        bytes=r.bytes,
        seconds=r.seconds,
        gbps=r.gbps,
        phases=r.phases,
        peak_memory_bytes=r.peak_extra_bytes["engine"],
        link_limit_gbps=r.link_gbps,
        extra={
            "sync": r.sync,
            "verified": r.verified,
            "live_engines": r.live_engines,
            "transfer_gbps": r.transfer_gbps,
            "fraction_of_link": r.gbps / r.link_gbps if r.link_gbps else None,
            "peak_extra_bytes": r.peak_extra_bytes,
            "rss_bytes": r.rss_bytes,
            "cpu_seconds": r.cpu_seconds,
            "cpu_busy_cores": r.cpu_busy_cores,
            **({"broadcast_calls": r.broadcast_calls} if r.broadcast_calls else {}),
            "dead_replicas": list(r.dead_replicas),
            "pulls_before_kill": {str(k): v for k, v in r.pulls_before_kill.items()},
            "group_size": config.options.group_size,
            "lookahead": config.options.lookahead,
            "direct": config.options.direct,
            "engine_kind": config.engine_kind,
            **(link_conditions() if link is None else link),
            "engine_dtype": config.model.engine_dtype,
            "launcher": r.launcher,
            "trainer_devices": list(config.placement.trainer_devices),
            "engine_devices": list(config.placement.used_engine_devices()),
            "placement": config.placement.mode,
            **r.link_bytes,
            "copy_executor": "+".join(sorted(r.copy_executors)) or None,
            "copy_executor_bytes": dict(r.copy_executors),
            "delta": config.delta,
            **({"delta_summary": r.delta} if r.delta else {}),
            **(extra or {}),
        },
    )


def raw_rows(transport: str, sizes: tuple[int, ...] = RAW_SIZES, repeats: int = 5) -> list[Row]:
    """Raw reads between two Ray actors with ``transport`` (the ceiling a sync's transfer phase is held to)."""
    from kvmove.transport.bandwidth import measure_bandwidth

    rows = []
    for n in sizes:
        b = measure_bandwidth(transport, n, repeats)
        rows.append(
            Row(
                kind="measured",
                suite="transport",
                name=f"raw {transport}",
                transport=transport,
                bytes=n,
                seconds=b.seconds,
                gbps=b.gb_per_s,
                extra={"processes": b.processes, "repeats": repeats},
            )
        )
    return rows


def sync_suite(
    model: str = "qwen3-moe-small",
    trainer: str = "tp=2,pp=2,ep=2",
    engine: str = "tp=2,ep=2",
    replicas: int = 2,
    transport: str = "auto",
    syncs: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Raw bandwidth, then ``syncs`` verified syncs of every strategy, all in one Ray session."""
    config = SyncConfig(
        model=resolve_model(model),
        trainer=TrainerLayout.parse(trainer),
        engine=EngineLayout.parse(engine, replicas),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        transport=transport,
        syncs=syncs,
        verify=True,
    )
    name = check_transport(config)
    config = replace(config, transport=name)
    start_ray(None)
    say = progress or (lambda _m: None)
    say(f"raw {name} bandwidth")
    raw = raw_rows(name)
    cls = get_transport(name)
    concurrent = None if cls.group_member or cls.actor_group else concurrent_row(name, config.engine.world)
    say("raw gloo broadcast to the engine ranks")
    broadcast = broadcast_row(1 + config.engine.world)
    results = list(run_syncs(config, progress=say))
    ceiling = max(r.gbps for r in raw)
    shared = concurrent.gbps if concurrent is not None else 0.0
    rows, link = [], link_conditions()
    for r in results:
        pulls = STRATEGIES[r.strategy].pulls
        extra: dict[str, object] = {
            "raw_gbps": ceiling,
            "transfer_fraction_of_raw": r.transfer_gbps / ceiling if ceiling and pulls else None,
            "raw_concurrent_gbps": shared or None,
            "transfer_fraction_of_concurrent_raw": r.transfer_gbps / shared if shared and pulls else None,
            "raw_broadcast_gbps": broadcast.gbps,
            "raw_broadcast_members": broadcast.extra["members"],
        }
        rows.append(sync_row(config, r, extra=extra, link=link))
    return raw + ([concurrent] if concurrent is not None else []) + [broadcast] + rows


def broadcast_row(members: int) -> Row:
    """The raw gloo broadcast of the run's broadcast group (trainer rank 0 and every engine rank,
    ``kvmove.bench.rawcast``): the line rate of the broadcast's bytes between these processes."""
    from kvmove.bench.rawcast import measure_broadcast

    b = measure_broadcast(members)
    return Row(
        kind="measured",
        suite="transport",
        name=f"raw gloo broadcast x{members}",
        transport="gloo-broadcast",
        bytes=b.nbytes,
        seconds=b.seconds,
        gbps=b.gb_per_s,
        extra={"processes": "ray", "members": members, "repeats": b.repeats, "fresh_receive_buffers": True},
    )


def concurrent_row(transport: str, pairs: int, nbytes: int = 16 << 20, repeats: int = 5) -> Row:
    """Per-reader raw bandwidth while ``pairs`` reader actors read at once (as a sync's engine ranks do)."""
    from kvmove.transport.bandwidth import measure_concurrent

    c = measure_concurrent(transport, nbytes, pairs, repeats)
    return Row(
        kind="measured",
        suite="transport",
        name=f"raw {transport} x{pairs} concurrent",
        transport=transport,
        bytes=nbytes,
        seconds=nbytes / (c.per_reader_gb_per_s * 1e9),
        gbps=c.per_reader_gb_per_s,
        extra={"processes": "ray", "pairs": pairs, "repeats": repeats, "aggregate_gbps": c.aggregate_gb_per_s},
    )


def summarize(rows: list[Row]) -> dict[str, float]:
    """Mean seconds per strategy and the v3 ratios the issue asks for (same run)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.suite == "sync":
            by.setdefault(r.strategy, []).append(r.seconds)
    mean = {s: statistics.mean(v) for s, v in by.items()}
    out = {f"mean_seconds_{s}": v for s, v in mean.items()}
    if "v3" in mean:
        out |= {f"v3_speedup_vs_{s}": mean[s] / mean["v3"] for s in ("v1", "v2", "broadcast") if s in mean}
    for key in ("transfer_fraction_of_raw", "transfer_fraction_of_concurrent_raw"):
        values = [float(v) for r in rows if r.suite == "sync" and r.strategy == "v3" and (v := r.extra.get(key))]
        if values:
            out[f"v3_{key}"] = statistics.mean(values)
    return out


def vllm_suite(
    model: str = "qwen3-moe-vllm",
    trainer: str = "tp=2,ep=2",
    engine: str = "tp=1",
    replicas: int = 2,
    transport: str = "auto",
    syncs: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """The same syncs into kvmove's reference engine and into live vLLM engines, side by side in one run; each row
    carries ``engine_model_bytes`` (the served model's bytes per engine rank) next to ``peak_extra_bytes``."""
    from kvmove.models.checkpoint import engine_tensors

    rows = []
    served = sum(t.nbytes for t in engine_tensors(resolve_model(model))) // EngineLayout.parse(engine).ranks_per_replica
    for kind in ("reference", "vllm"):
        config = SyncConfig(
            model=resolve_model(model),
            trainer=TrainerLayout.parse(trainer),
            engine=EngineLayout.parse(engine, replicas),
            strategies=tuple(parse_strategies("v1,v2,v3")),
            transport=transport,
            syncs=syncs,
            verify=True,
            engine_kind=kind,
        )
        extra: dict[str, object] = {"engine_model_bytes": served}
        link = link_conditions()
        rows += [sync_row(config, r, "vllm", extra, link) for r in run_syncs(config, progress=progress)]
    return rows
