"""One sync, end to end: rejoin, inject faults, perturb, run trainer loops and engine pulls, verify, measure."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout
from kvmove.sync.engine import EngineStats
from kvmove.sync.runner import Cluster, SyncResult, trainer_syncs
from kvmove.sync.strategies import Strategy
from kvmove.sync.trainer import TrainerStats


def run_one(cluster: Cluster, strategy: Strategy, index: int, sync_id: int, version: int) -> SyncResult:
    c, ray = cluster.config, cluster.ray
    notes: list[str] = []
    rejoined = sorted(cluster.dead_replicas())
    for replica in rejoined:
        cluster.restart_replica(replica)
        notes.append(f"replica {replica} restarted and rejoined")
    for f in c.faults:
        if f.sync == index and not f.during and f.replica not in cluster.dead_replicas():
            cluster.kill_replica(f.replica)
            notes.append(f"replica {f.replica} killed before sync {index}")
    ray.get([t.prepare.remote(version) for t in cluster.trainers])
    live = [e for e in range(c.engine.world) if e not in cluster.dead]
    start = time.perf_counter()
    if strategy.scope == "root":
        t_refs, e_refs = _launch_broadcast(cluster, sync_id, live)
    else:
        t_refs = [
            t.run_sync.remote(ts)
            for t, ts in zip(cluster.trainers, trainer_syncs(cluster, strategy, sync_id, version), strict=True)
        ]
        delays = dict(c.slow_replicas)
        e_refs = {
            e: cluster.engines[e].run_sync.remote(
                sync_id, strategy.name, strategy.name == "v3", delays.get(c.engine.coord(e).replica, 0.0), c.deadline_s
            )
            for e in live
        }
    dropped: set[int] = set()
    killer = _mid_sync_killer(cluster, index, sync_id, notes, dropped)
    engine_stats, done_at = _collect_engines(cluster, e_refs, sync_id, start, notes, dropped)
    if killer is not None:
        killer.join()
        for e in cluster.dead:  # a replica killed after it finished is still out of this sync's results
            engine_stats.pop(e, None)
            done_at.pop(e, None)
    trainer_stats = _collect_trainers(cluster, t_refs, notes)
    seconds = time.perf_counter() - start
    verified, mismatched = _verify(cluster, version) if c.verify else (None, ())
    return build_result(
        SyncContext(
            c.engine, c.trainer.world, cluster.transport, tuple(sorted(cluster.dead_replicas())), tuple(rejoined)
        ),
        strategy,
        index,
        seconds,
        verified,
        engine_stats,
        trainer_stats,
        done_at,
        notes,
        mismatched,
    )


def _launch_broadcast(cluster: Cluster, sync_id: int, live: list[int]) -> tuple[list[Any], dict[int, Any]]:
    c, ray = cluster.config, cluster.ray
    host, port = ray.get(cluster.trainers[0].address.remote(c.ray_address is None))
    size, prefix = 1 + len(live), f"bcast-{sync_id}"
    t_refs = [t.broadcast_sync.remote(host, port, size, prefix, c.deadline_s) for t in cluster.trainers]
    e_refs = {
        e: cluster.engines[e].broadcast_receive.remote(host, port, 1 + i, size, prefix, c.deadline_s)
        for i, e in enumerate(live)
    }
    return t_refs, e_refs


def _mid_sync_killer(
    cluster: Cluster, index: int, sync_id: int, notes: list[str], dropped: set[int]
) -> threading.Thread | None:
    mid = [f for f in cluster.config.faults if f.sync == index and f.during]
    if not mid:
        return None

    def kill() -> None:
        time.sleep(0.3)  # the sync is under way: pulls have started
        for f in mid:
            first = cluster.replica_ranks(f.replica)[0]
            _drop_replica(cluster, first, sync_id, notes, dropped, f"replica {f.replica} killed during sync {index}")

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _collect_engines(
    cluster: Cluster, e_refs: dict[int, Any], sync_id: int, start: float, notes: list[str], dropped: set[int]
) -> tuple[dict[int, EngineStats], dict[int, float]]:
    """Wait for every live engine rank; a failed or late rank takes its whole replica out of this sync."""
    c, ray = cluster.config, cluster.ray
    pending = {ref: e for e, ref in e_refs.items()}
    stats: dict[int, EngineStats] = {}
    done_at: dict[int, float] = {}
    deadline = time.monotonic() + c.deadline_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.05, deadline - time.monotonic()))
        if not ready:
            for e in sorted(set(pending.values())):
                why = f"engine rank {e} missed the {c.deadline_s:.0f} s deadline"
                _drop_replica(cluster, e, sync_id, notes, dropped, why)
            break
        ref = ready[0]
        e = pending.pop(ref)
        try:
            stats[e] = ray.get(ref)
            done_at[e] = time.perf_counter() - start
        except Exception as exc:  # a dead actor or a failed pull: the replica is out of this sync
            _drop_replica(cluster, e, sync_id, notes, dropped, f"engine rank {e} failed: {type(exc).__name__}")
    for e in cluster.dead:
        stats.pop(e, None)
        done_at.pop(e, None)
    return stats, done_at


def _drop_replica(cluster: Cluster, engine: int, sync_id: int, notes: list[str], dropped: set[int], why: str) -> None:
    """Take ``engine``'s whole replica out of this sync: kill what is left of it, tell every trainer rank."""
    replica = cluster.config.engine.coord(engine).replica
    if replica in dropped:
        return
    dropped.add(replica)
    notes.append(why + f"; replica {replica} dropped from this sync")
    cluster.kill_replica(replica)
    for e in cluster.replica_ranks(replica):
        for t in cluster.trainers:
            t.engine_gone.remote(sync_id, e)


def _collect_trainers(cluster: Cluster, t_refs: list[Any], notes: list[str]) -> list[TrainerStats]:
    try:
        return list(cluster.ray.get(t_refs, timeout=cluster.config.deadline_s + 10))
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc
        raise KvmoveError(f"trainer ranks failed this sync: {type(cause).__name__}: {cause}".splitlines()[0]) from None


def _verify(cluster: Cluster, version: int) -> tuple[bool | None, tuple[int, ...]]:
    """(verified, engine ranks that differ); verified is None when no engine rank is live to check."""
    live = [e for e in range(cluster.config.engine.world) if e not in cluster.dead]
    results = cluster.ray.get([cluster.engines[e].verify.remote(version, cluster.config.seed) for e in live])
    bad = tuple(e for e, (ok, _) in zip(live, results, strict=True) if not ok)
    return (not bad if live else None), bad


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class SyncContext(NamedTuple):
    """What a result needs to know about the run beyond the stats of its ranks."""

    engine: EngineLayout
    trainer_ranks: int
    transport: str
    dead_replicas: tuple[int, ...] = ()
    rejoined_replicas: tuple[int, ...] = ()
    broadcast_backend: str = "gloo"


def build_result(
    ctx: SyncContext,
    strategy: Strategy,
    index: int,
    seconds: float,
    verified: bool | None,
    engines: dict[int, EngineStats],
    trainers: list[TrainerStats],
    done_at: dict[int, float],
    notes: list[str],
    mismatched: tuple[int, ...] = (),
) -> SyncResult:
    """One sync's result from the stats its trainer and engine ranks returned."""
    total = sum(s.bytes_received for s in engines.values())
    phases = {
        "gather": max((t.gather_seconds for t in trainers), default=0.0),
        "pack": max((t.pack_seconds for t in trainers), default=0.0),
        "request": max((s.request_seconds for s in engines.values()), default=0.0),
        "transfer": max((s.transfer_seconds for s in engines.values()), default=0.0),
        "load": max((s.load_seconds for s in engines.values()), default=0.0),
        "trainer_wait": max((t.wait_seconds for t in trainers), default=0.0),
    }
    replica_seconds: dict[int, float] = {}
    for e, t in done_at.items():
        r = ctx.engine.coord(e).replica
        replica_seconds[r] = max(replica_seconds.get(r, 0.0), t)
    return SyncResult(
        strategy=strategy.name,
        transport=f"{ctx.broadcast_backend}-broadcast" if strategy.scope == "root" else ctx.transport,
        sync=index,
        seconds=seconds,
        bytes=total,
        gbps=total / seconds / 1e9 if seconds > 0 else 0.0,
        transfer_gbps=_mean(
            [s.bytes_received / s.transfer_seconds / 1e9 for s in engines.values() if s.transfer_seconds > 0]
        ),
        verified=verified,
        engine_ranks=ctx.engine.world,
        trainer_ranks=ctx.trainer_ranks,
        live_engines=len(engines),
        dead_replicas=ctx.dead_replicas,
        rejoined_replicas=ctx.rejoined_replicas,
        phases=phases,
        peak_extra_bytes={
            "trainer": max((t.peak_extra_bytes for t in trainers), default=0),
            "engine": max((s.peak_extra_bytes for s in engines.values()), default=0),
        },
        bytes_per_engine_rank=tuple(engines[e].bytes_received if e in engines else 0 for e in range(ctx.engine.world)),
        bytes_per_trainer_rank=tuple(t.bytes_served for t in trainers),
        replica_seconds=replica_seconds,
        notes=tuple(notes),
        mismatched_ranks=mismatched,
    )
