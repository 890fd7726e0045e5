"""Plan benchmark: full-size sharding plans and source maps for every engine rank, time and peak memory.

Each case runs in a fresh process so its peak resident memory is its own.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import time
from typing import NamedTuple

from kvmove.bench.results import Row
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.plan import plan_engine
from kvmove.sync.planning.routing import route
from kvmove.sync.strategies import STRATEGIES


class PlanCase(NamedTuple):
    name: str
    model: str
    trainer: str
    engine: str
    replicas: int


PLAN_CASES = (
    PlanCase("kimi-k2 published", "kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32", 4),
    PlanCase("qwen3-235b published", "qwen3-235b-a22b", "tp=4,pp=2,ep=8", "dp=16,ep=16", 1),
)


class PlanBench(NamedTuple):
    plan_seconds: float
    route_seconds: dict[str, float]
    bytes_total: int
    regions: int
    balance: dict[str, float]
    baseline_rss: int
    peak_rss: int


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(case: PlanCase) -> PlanBench:
    """Plan every rank of one replica, route every strategy over all replicas (in this process)."""
    cfg = resolve_model(case.model)
    trainer, engine = TrainerLayout.parse(case.trainer), EngineLayout.parse(case.engine, case.replicas)
    trainer.validate(cfg)
    engine.validate(cfg)
    baseline = _rss_bytes()
    start = time.perf_counter()
    plans = plan_engine(cfg, engine)
    plan_seconds = time.perf_counter() - start
    ownership = Ownership(cfg, trainer)
    route_seconds, balance, total = {}, {}, 0
    for s in STRATEGIES.values():
        start = time.perf_counter()
        smap = route(plans, engine, ownership, s)
        route_seconds[s.name] = time.perf_counter() - start
        balance[s.name] = smap.balance
        total = sum(smap.bytes_per_engine)
    regions = sum(len(p.regions) for p in plans)
    return PlanBench(plan_seconds, route_seconds, total, regions, balance, baseline, _rss_bytes())


def _child(case: PlanCase, queue: mp.Queue) -> None:
    queue.put(measure(case))


def measure_isolated(case: PlanCase) -> PlanBench:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(case, queue))
    proc.start()
    result: PlanBench = queue.get()
    proc.join()
    return result


def plan_rows(cases: tuple[PlanCase, ...] = PLAN_CASES) -> list[Row]:
    rows = []
    for case in cases:
        b = measure_isolated(case)
        for strategy in ("v2", "v1"):
            seconds = b.plan_seconds + b.route_seconds[strategy]
            rows.append(
                Row(
                    kind="measured",
                    suite="plan",
                    name=f"plan {case.name}",
                    model=case.model,
                    trainer=case.trainer,
                    engine=f"{case.engine} x{case.replicas}",
                    strategy=strategy,
                    bytes=b.bytes_total,
                    seconds=seconds,
                    phases={"dry_run": b.plan_seconds, "route": b.route_seconds[strategy]},
                    peak_memory_bytes=b.peak_rss,
                    extra={
                        "baseline_rss_bytes": b.baseline_rss,
                        "plan_peak_extra_bytes": b.peak_rss - b.baseline_rss,
                        "regions_per_replica": b.regions,
                        "load_balance": round(b.balance[strategy], 4),
                    },
                )
            )
    return rows
