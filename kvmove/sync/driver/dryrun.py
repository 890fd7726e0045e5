"""The dry-run driver: plans and source maps for each strategy of a SyncConfig, optionally verified in-process on
seeded weights, and the bytes each rank would move over the link (for an FP8 engine: FP8 weights and scales
where the trainer quantizes, BF16 covers where the engine does); no rank starts and no byte moves."""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from kvmove.engines import get_engine
from kvmove.models.checkpoint import SCALE_SUFFIX, engine_tensors
from kvmove.models.table import hf_tensors
from kvmove.quant import FP8_DTYPE
from kvmove.sync.config import SyncConfig
from kvmove.sync.driver.checks import check_layouts, check_plannable
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.plan import ShardingPlan, plan_engine
from kvmove.sync.planning.routing import SourceMap, route
from kvmove.sync.strategies import Delivery, Strategy
from kvmove.sync.verify import verify_plans


class DryRunReport(NamedTuple):
    strategy: str
    model: str
    trainer: str
    engine: str
    plan_seconds: float
    bytes_total: int
    bytes_per_engine_rank_max: int
    bytes_per_trainer_rank_max: int
    load_balance: float
    regions: int
    engine_ranks: int
    trainer_ranks: int
    verified: bool | None
    mismatches: tuple[str, ...]
    engine_dtype: str = "bf16"
    bytes_by_transform: dict[str, int] = {}  # noqa: RUF012 - NamedTuple defaults are never mutated
    """Bytes on the link by transform: ``plain`` (as the trainer holds them), FP8 weights and scales quantized on
    the ``trainer``, BF16 covers quantized on the ``engine`` (kvmove.sync.planning.entries)."""

    def as_json(self) -> dict[str, Any]:
        out = self._asdict()
        out["mismatches"] = list(self.mismatches)
        out["plan_seconds"] = round(self.plan_seconds, 4)
        out["load_balance"] = round(self.load_balance, 4)
        return out


class EnginePlans(NamedTuple):
    """The plans of one replica's engine ranks, and the seconds planning took."""

    plans: tuple[ShardingPlan, ...]
    seconds: float


def build_plans(config: SyncConfig) -> EnginePlans:
    """Dry-run the engine loader for every rank of one replica (layouts validated first)."""
    check_layouts(config)
    start = time.perf_counter()
    plans = plan_engine(config.model, config.engine, reuse=config.options.reuse, engine=get_engine(config.engine_kind))
    return EnginePlans(plans, time.perf_counter() - start)


def dry_run_sync(config: SyncConfig) -> list[DryRunReport]:
    """Check what a dry run is refused for (kvmove.sync.driver.checks), plan once, route per strategy, verify if
    asked: one report per strategy."""
    with _collector_paused():
        # NOTE: planned in a call of its own, so the plans are freed before the collector resumes: its first pass
        # walks every object allocated while it was paused (Kimi K2: a million left alive cost 0.4 s)
        return _reports(config)


def _reports(config: SyncConfig) -> list[DryRunReport]:
    check_plannable(config)
    plans, plan_seconds = build_plans(config)
    shared = _Shared(Ownership(config.model, config.trainer), {})
    return [_report(config, plans, plan_seconds, shared, s) for s in config.strategies]


@contextmanager
def _collector_paused() -> Iterator[None]:
    """CPython's cycle collector paused while planning: plans are millions of small acyclic tuples, and each of its
    full passes walks every live object (Kimi K2: planning took twice as long with it running)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Shared:
    """What the strategies of one dry run plan alike: the ownership, one direct planner, entries by gather."""

    def __init__(self, ownership: Ownership, memo: dict[Hashable, Any]) -> None:
        self.ownership, self.memo = ownership, memo
        self._direct: DirectPlanner | None = None

    def direct(self, config: SyncConfig) -> DirectPlanner:
        if self._direct is None:
            self._direct = DirectPlanner(self.ownership, hf_tensors(config.model))
        return self._direct


def _report(
    config: SyncConfig,
    plans: Sequence[ShardingPlan],
    plan_seconds: float,
    shared: _Shared,
    s: Strategy,
) -> DryRunReport:
    start = time.perf_counter()
    ownership = shared.ownership
    # NOTE: routed as a sync routes it (direct pulls, pieces), so the verification covers what a sync reads
    direct = shared.direct(config) if config.options.direct and s.direct else None
    smap = None
    if s.pulls or config.verify:  # broadcast's bytes are the whole model's: only its verification reads routes
        smap = route(plans, config.engine, ownership, s, direct, shard_reads=config.options.direct, memo=shared.memo)
    seconds = plan_seconds + time.perf_counter() - start
    verified: bool | None = None
    mismatches: tuple[str, ...] = ()
    if smap is not None and config.verify:
        result = verify_plans(
            config.model,
            config.engine,
            plans,
            ownership,
            smap,
            s.scope,
            seed=config.seed,
            engine=get_engine(config.engine_kind),
        )
        verified, mismatches = result.ok, result.mismatches
    per_engine, per_trainer, balance = _traffic(config, smap, s)
    return DryRunReport(
        s.name,
        config.model.name,
        config.trainer.label(),
        config.engine.label(),
        seconds,
        sum(per_engine),
        max(per_engine),
        max(per_trainer),
        balance,
        sum(len(p.regions) for p in plans),
        config.engine.world,
        config.trainer.world,
        verified,
        mismatches,
        config.model.engine_dtype,
        _pulled_bytes(config, smap) if smap is not None and s.pulls else _broadcast_bytes(config),
    )


def _pulled_bytes(config: SyncConfig, smap: SourceMap) -> dict[str, int]:
    """What the engine ranks pull, by transform (kvmove.sync.planning.entries)."""
    out: dict[str, int] = defaultdict(int)
    for e in range(config.engine.world):
        for name, n in smap.entries[config.engine.coord(e).local].bytes_by_transform().items():
            out[name] += n
    return dict(out)


class Traffic(NamedTuple):
    """Bytes received per engine rank and sent per trainer rank, and the trainer side's load balance."""

    per_engine: list[int]
    per_trainer: list[int]
    balance: float


def _traffic(config: SyncConfig, smap: SourceMap | None, s: Strategy) -> Traffic:
    """Bytes received per engine rank and sent per trainer rank; broadcast delivers the whole model (in the engine's
    format: rank 0 quantizes an FP8 engine's tensors before it broadcasts them)."""
    if smap is not None and s.delivery is not Delivery.BROADCAST:
        return Traffic(list(smap.bytes_per_engine), list(smap.bytes_per_trainer), smap.balance)
    model_bytes = sum(t.nbytes for t in engine_tensors(config.model))
    per_trainer = [model_bytes] + [0] * (config.trainer.world - 1)
    return Traffic([model_bytes] * config.engine.world, per_trainer, float(config.trainer.world))


def _broadcast_bytes(config: SyncConfig) -> dict[str, int]:
    """What the broadcast baseline sends every engine rank, by transform: rank 0 quantizes FP8 tensors whole."""
    out: dict[str, int] = defaultdict(int)
    for t in engine_tensors(config.model):
        quantized = t.dtype == FP8_DTYPE or t.name.endswith(SCALE_SUFFIX)
        out["trainer" if quantized else "plain"] += t.nbytes * config.engine.world
    return dict(out)
