"""One sync's result, built from what its trainer and engine ranks returned (the same for every launcher)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvmove.models.layout import EngineLayout
from kvmove.sync.delta.detect import summary
from kvmove.sync.ranks.calltimes import CallTimes
from kvmove.sync.ranks.control import EngineStats, TrainerStats
from kvmove.sync.strategies import Delivery, Strategy


class SyncResult(NamedTuple):
    strategy: str
    transport: str
    sync: int
    seconds: float
    bytes: int
    gbps: float
    transfer_gbps: float
    """Mean over engine ranks of bytes received / seconds spent in the transport's reads."""
    verified: bool | None
    engine_ranks: int
    trainer_ranks: int
    live_engines: int
    dead_replicas: tuple[int, ...]
    rejoined_replicas: tuple[int, ...]
    phases: dict[str, float]
    peak_extra_bytes: dict[str, int]
    bytes_per_engine_rank: tuple[int, ...]
    bytes_per_trainer_rank: tuple[int, ...]
    replica_seconds: dict[int, float]
    notes: tuple[str, ...]
    launcher: str = ""
    link_gbps: float = 0.0
    """This run's copy ceiling between a trainer's and an engine's device, measured at init (speed of light)."""
    rss_bytes: dict[str, int] = {}  # noqa: RUF012 - NamedTuple defaults are never mutated
    """Largest resident memory of a trainer and of an engine rank process when their part of the sync ended."""
    pulls_before_kill: dict[int, int] = {}  # noqa: RUF012
    """Engine rank -> pulls it had finished when a fault killed it during this sync."""
    mismatches: tuple[str, ...] = ()
    """With verification: parameters that differ (at most a few per rank)."""
    mismatched_ranks: tuple[int, ...] = ()
    """Engine ranks whose parameters differ from the loader's (``verified`` is False); ``verified`` is None when
    not checked, or when no engine rank was live to check."""
    copy_executors: dict[str, int] = {}  # noqa: RUF012
    """Bytes the engine ranks' transports moved per copy executor (``kvmove.transport.executors``: "driver",
    "triton"; "views": torch copies), summed over ranks; empty where the transport runs no copy plans."""
    link_bytes: dict[str, int] = {}  # noqa: RUF012
    """The planned payload split by where it travels (``kvmove.sync.planning.ceiling.LinkBytes.as_json``: bytes that
    stay on a device and bytes that cross a link, and those of the busiest device and link direction); empty for the
    broadcast baseline."""
    delta: dict[str, Any] = {}  # noqa: RUF012
    """Delta syncs (``kvmove.sync.delta.summary``): dense and sent bytes of the packed pulls, pulls per encoding,
    and the changed fraction of each region class's compared words; empty when the sync ran dense."""
    cpu_seconds: dict[str, float] = {}  # noqa: RUF012
    """CPU seconds the sync's processes spent while it ran (every thread of each): ``trainer`` and ``engine`` summed
    over their ranks, ``trainer_busiest`` and ``engine_busiest`` the most one rank spent, ``driver`` this process.
    Over ``seconds`` and a host's cores they say how busy the host was (``cpu_busy_cores``); a vLLM engine rank
    counts its actor's process, like any engine rank (``kvmove.sync.ranks.host.finished``)."""
    broadcast_calls: dict[str, float] = {}  # noqa: RUF012
    """The broadcast baseline: its root's sends, one per tensor, as the sums of
    ``kvmove.sync.ranks.calltimes.CallTimes`` (a line through them splits a send's fixed cost from its bytes);
    empty for the pull strategies."""

    @property
    def cpu_busy_cores(self) -> float:
        """Cores the sync's processes kept busy on average: their CPU seconds over the sync's seconds (meaningful
        where every rank shares one host, as kvmove's CPU syncs do)."""
        c = self.cpu_seconds
        spent = c.get("trainer", 0.0) + c.get("engine", 0.0) + c.get("driver", 0.0)
        return spent / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        out = self._asdict()
        for key in ("seconds", "gbps", "transfer_gbps", "link_gbps"):
            out[key] = round(out[key], 5)
        out["phases"] = {k: round(v, 5) for k, v in self.phases.items()}
        out["replica_seconds"] = {str(k): round(v, 5) for k, v in self.replica_seconds.items()}
        out["pulls_before_kill"] = {str(k): v for k, v in self.pulls_before_kill.items()}
        for key in (
            "dead_replicas",
            "rejoined_replicas",
            "bytes_per_engine_rank",
            "bytes_per_trainer_rank",
            "notes",
            "mismatches",
            "mismatched_ranks",
        ):
            out[key] = list(out[key])
        return out


class Verification(NamedTuple):
    """The live engine ranks' checks of one sync: ``ok`` is None when no engine rank was live to check."""

    ok: bool | None
    ranks: tuple[int, ...]
    """Engine ranks whose parameters differ."""
    mismatches: tuple[str, ...]


@dataclass
class SyncContext:
    """What a result needs to know about the run and the sync beyond the stats of its ranks."""

    engine: EngineLayout
    trainer_ranks: int
    transport: str
    launcher: str
    link_gbps: float
    broadcast_backend: str
    dead_replicas: tuple[int, ...] = ()
    rejoined_replicas: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)
    pulls_before_kill: dict[int, int] = field(default_factory=dict)
    link_bytes: dict[str, int] = field(default_factory=dict)


def build_result(
    ctx: SyncContext,
    strategy: Strategy,
    index: int,
    seconds: float,
    verified: Verification | None,
    engines: dict[int, EngineStats],
    trainers: list[TrainerStats],
    done_at: dict[int, float],
    driver_cpu_seconds: float = 0.0,
) -> SyncResult:
    """One sync's result from the stats its trainer and engine ranks returned (``driver_cpu_seconds``: what the
    driver's process spent on the sync)."""
    total = sum(s.bytes_received for s in engines.values())
    return SyncResult(
        strategy=strategy.name,
        transport=f"{ctx.broadcast_backend}-broadcast" if strategy.delivery is Delivery.BROADCAST else ctx.transport,
        sync=index,
        seconds=seconds,
        bytes=total,
        gbps=total / seconds / 1e9 if seconds > 0 else 0.0,
        transfer_gbps=_mean(
            [s.bytes_received / s.transfer_seconds / 1e9 for s in engines.values() if s.transfer_seconds > 0]
        ),
        verified=None if verified is None else verified.ok,
        engine_ranks=ctx.engine.world,
        trainer_ranks=ctx.trainer_ranks,
        live_engines=len(engines),
        dead_replicas=ctx.dead_replicas,
        rejoined_replicas=ctx.rejoined_replicas,
        phases=_phases(engines, trainers),
        peak_extra_bytes={
            "trainer": max((t.peak_extra_bytes for t in trainers), default=0),
            "engine": max((s.peak_extra_bytes for s in engines.values()), default=0),
        },
        bytes_per_engine_rank=tuple(engines[e].bytes_received if e in engines else 0 for e in range(ctx.engine.world)),
        bytes_per_trainer_rank=tuple(t.bytes_served for t in trainers),
        replica_seconds=_replica_seconds(ctx.engine, done_at),
        notes=tuple(ctx.notes),
        launcher=ctx.launcher,
        link_gbps=ctx.link_gbps,
        rss_bytes={
            "trainer": max((t.rss_bytes for t in trainers), default=0),
            "engine": max((s.rss_bytes for s in engines.values()), default=0),
        },
        pulls_before_kill=dict(ctx.pulls_before_kill),
        mismatches=() if verified is None else verified.mismatches,
        mismatched_ranks=() if verified is None else verified.ranks,
        link_bytes=dict(ctx.link_bytes),
        copy_executors=_executors(engines.values()),
        delta=summary([t.delta for t in trainers]),
        cpu_seconds=_cpu_seconds(engines.values(), trainers, driver_cpu_seconds),
        broadcast_calls=_send_calls(trainers),
    )


def _send_calls(trainers: list[TrainerStats]) -> dict[str, float]:
    sums = [t.send_calls for t in trainers if t.send_calls.calls]
    return CallTimes(*map(sum, zip(*sums, strict=True))).as_json() if sums else {}


def _cpu_seconds(engines: Iterable[EngineStats], trainers: list[TrainerStats], driver: float) -> dict[str, float]:
    spent = {"trainer": [t.cpu_seconds for t in trainers], "engine": [s.cpu_seconds for s in engines]}
    out = {side: sum(v) for side, v in spent.items()} | {
        f"{side}_busiest": max(v, default=0.0) for side, v in spent.items()
    }
    return out | {"driver": driver}


def _executors(engines: Iterable[EngineStats]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in engines:
        for name, n in s.copy_executors.items():
            out[name] = out.get(name, 0) + n
    return out


def _phases(engines: dict[int, EngineStats], trainers: list[TrainerStats]) -> dict[str, float]:
    return {
        "gather": max((t.gather_seconds for t in trainers), default=0.0),
        "pack": max((t.pack_seconds for t in trainers), default=0.0),
        "request": max((s.request_seconds for s in engines.values()), default=0.0),
        "transfer": max((s.transfer_seconds for s in engines.values()), default=0.0),
        "load": max((s.load_seconds for s in engines.values()), default=0.0),
        "trainer_wait": max((t.wait_seconds for t in trainers), default=0.0),
    }


def _replica_seconds(engine: EngineLayout, done_at: dict[int, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for e, t in done_at.items():
        r = engine.coord(e).replica
        out[r] = max(out.get(r, 0.0), t)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
