"""One sync: plan (rejoin, faults, the trainers' step) -> transfer (every rank's part, collected) -> commit (verify,
result). A dead or late engine replica is taken out of the sync (its ranks no longer count, so no trainer waits
for it) and rejoins at the next one; a trainer rank that fails ends the run in one line, as fast as it is seen.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvmove.errors import JobFailed, KvmoveError
from kvmove.sync.config import Side
from kvmove.sync.driver.faults import FaultHooks
from kvmove.sync.driver.result import SyncContext, SyncResult, Verification, build_result
from kvmove.sync.driver.running import RunningRanks
from kvmove.sync.launchers.base import Call, RankDied
from kvmove.sync.planning.blueprint import TrainerSync
from kvmove.sync.ranks.control import (
    EngineGone,
    EngineStats,
    ReceiveBroadcast,
    RunPulls,
    RunSync,
    SendBroadcast,
    StepWeights,
    TrainerStats,
    VerifyWeights,
)
from kvmove.sync.strategies import Delivery, Strategy


class RunFailed(JobFailed):
    """The run cannot go on (a trainer rank died or failed): the job ran and failed."""


@dataclass
class Step:
    """One sync as planned: which ranks take part, which die where, and what the result will say."""

    strategy: Strategy
    index: int
    sync_id: int
    version: int
    ctx: SyncContext
    live: list[int] = field(default_factory=list)
    loops: list[TrainerSync] = field(default_factory=list)
    engine_deaths: dict[int, int] = field(default_factory=dict)
    trainer_deaths: dict[int, int] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)
    background: list[Call] = field(default_factory=list)


class Outcome:
    """What the transfer collected: each rank's stats and when each engine rank finished."""

    def __init__(self) -> None:
        self.engines: dict[int, EngineStats] = {}
        self.trainers: dict[int, TrainerStats] = {}
        self.done_at: dict[int, float] = {}
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        """What this (the driver's) process spent while the ranks ran the sync."""


def run_sync(ranks: RunningRanks, hooks: FaultHooks, strategy: Strategy, index: int, sync_id: int) -> SyncResult:
    """Sync ``index`` (counted per strategy) of ``strategy``; ``sync_id`` counts every sync of the run."""
    step = plan(ranks, hooks, strategy, index, sync_id)
    outcome = transfer(ranks, step)
    return commit(ranks, step, outcome)


# -- plan ------------------------------------------------------------------------------------------------------
def plan(ranks: RunningRanks, hooks: FaultHooks, strategy: Strategy, index: int, sync_id: int) -> Step:
    c = ranks.config
    backend = "nccl" if c.placement.engine_device(0).startswith("cuda") else "gloo"
    ctx = SyncContext(c.engine, c.trainer.world, c.transport, c.placement.launcher, ranks.link_gbps, backend)
    ctx.notes += ranks.notes
    split = ranks.blueprint.link_bytes(strategy.name, ranks.live_engines())
    ctx.link_bytes = split.as_json() if split is not None else {}
    ctx.rejoined_replicas = tuple(sorted(ranks.dead_replicas()))
    for replica in ctx.rejoined_replicas:
        ranks.restart_replica(replica)
        ctx.notes.append(f"replica {replica} restarted and rejoined")
    for replica in hooks.before(index, Side.ENGINE):
        if replica not in ranks.dead_replicas():
            ranks.kill_replica(replica)
            ctx.notes.append(f"replica {replica} killed before sync {index}")
    for rank in hooks.before(index, Side.TRAINER):
        ranks.trainers[rank].kill()
    step = Step(strategy, index, sync_id, sync_id, ctx, live=ranks.live_engines())
    _trainer_calls(ranks, step, StepWeights(step.version))
    _plan_work(ranks, hooks, step)
    return step


def _plan_work(ranks: RunningRanks, hooks: FaultHooks, step: Step) -> None:
    """Each trainer rank's loop (pull strategies) and where mid-sync faults strike (half of each rank's work)."""
    c, bp, name = ranks.config, ranks.blueprint, step.strategy.name
    if step.strategy.pulls:
        step.loops = bp.trainer_syncs(step.strategy, step.sync_id, step.version, set(step.live))
        if c.delta:
            bases = delta_bases(ranks, step)
            step.loops = [replace(loop, delta=bases) for loop in step.loops]
        trainer_work = {t: len(loop.groups) for t, loop in enumerate(step.loops)}
        engine_work = {e: len(bp.pulls[name][e].pulls) for e in step.live}
    else:  # broadcast: every trainer rank takes part in every tensor's gather
        trainer_work, engine_work = dict.fromkeys(range(c.trainer.world), len(ranks.tensors)), {}
    step.engine_deaths = hooks.engine_deaths(step.index, set(step.live), engine_work)
    step.trainer_deaths = hooks.trainer_deaths(step.index, trainer_work)


# -- transfer --------------------------------------------------------------------------------------------------
def transfer(ranks: RunningRanks, step: Step) -> Outcome:
    """Start every rank's part of the sync, then collect it (see ``_collect``)."""
    outcome = Outcome()
    start, cpu = time.perf_counter(), time.process_time()
    trainer_calls, engine_calls = LAUNCH[step.strategy.delivery](ranks, step)
    _collect(ranks, step, outcome, start, trainer_calls, engine_calls)
    outcome.seconds = time.perf_counter() - start
    outcome.cpu_seconds = time.process_time() - cpu
    return outcome


class Launched(NamedTuple):
    """A started sync's calls: the trainer ranks' in rank order, and each live engine rank's."""

    trainers: list[Call]
    engines: dict[int, Call]


def _launch_pulls(ranks: RunningRanks, step: Step) -> Launched:
    c = ranks.config
    trainer_calls = [
        t.submit(RunSync(loop, step.trainer_deaths.get(r)))
        for r, (t, loop) in enumerate(zip(ranks.trainers, step.loops, strict=True))
    ]
    delays = dict(c.slow_replicas)
    engine_calls = {}
    for e in step.live:
        delay = delays.get(c.engine.coord(e).replica, 0.0)
        command = RunPulls(step.sync_id, step.strategy, delay, step.engine_deaths.get(e))
        engine_calls[e] = ranks.engines[e].submit(command)
    return Launched(trainer_calls, engine_calls)


def _launch_broadcast(ranks: RunningRanks, step: Step) -> Launched:
    group = ranks.broadcast_group(step.live, step.sync_id)
    trainer_calls = [t.submit(SendBroadcast(group, step.trainer_deaths.get(r))) for r, t in enumerate(ranks.trainers)]
    engine_calls = {e: ranks.engines[e].submit(ReceiveBroadcast(group, 1 + i)) for i, e in enumerate(step.live)}
    return Launched(trainer_calls, engine_calls)


LAUNCH = {Delivery.PULL: _launch_pulls, Delivery.BROADCAST: _launch_broadcast}
"""How each delivery starts a sync."""


def _collect(
    ranks: RunningRanks, step: Step, outcome: Outcome, start: float, trainers: list[Call], engines: dict[int, Call]
) -> None:
    """Wait for every rank at once. A trainer rank's failure ends the run at once; an engine rank's failure (or
    missed deadline) takes its replica out of the sync; every wait ends at the deadline."""
    launcher, deadline_s = ranks.launcher, ranks.config.deadline_s
    pending: dict[Call, tuple[Side, int]] = {call: (Side.TRAINER, r) for r, call in enumerate(trainers)}
    pending |= {call: (Side.ENGINE, e) for e, call in engines.items()}
    deadline = time.monotonic() + deadline_s
    while pending:
        ready = launcher.wait(list(pending), max(0.0, deadline - time.monotonic()))
        if not ready:
            _missed_deadline(ranks, step, pending)
            return
        for call in ready:
            side, rank = pending.pop(call)
            if side is Side.TRAINER:
                outcome.trainers[rank] = _trainer_result(ranks, step, call)
                continue
            try:
                outcome.engines[rank] = launcher.result(call)
                outcome.done_at[rank] = time.perf_counter() - start
            except KvmoveError as exc:
                _engine_failed(ranks, step, rank, exc)
    for e in ranks.dead:  # a replica taken out after one of its ranks finished is out of this sync's results
        outcome.engines.pop(e, None)
        outcome.done_at.pop(e, None)


def _trainer_result(ranks: RunningRanks, step: Step, call: Call) -> Any:
    try:
        return ranks.launcher.result(call)
    except KvmoveError as exc:
        raise _fatal(ranks, step, call.rank.spec.rank, exc) from None


def _fatal(ranks: RunningRanks, step: Step, rank: int, exc: BaseException) -> RunFailed:
    faulted = any(f.side is Side.TRAINER and f.target == rank and f.sync == step.index for f in ranks.config.faults)
    return RunFailed(
        f"trainer rank {rank} {'killed by a fault' if faulted else 'failed'} at {step.strategy.name} sync "
        f"{step.index} ({exc}); a sync needs every trainer rank, so the run ends here"
    )


def _trainer_calls(ranks: RunningRanks, step: Step, command: Any) -> list[Any]:
    """``command`` to every trainer rank; a dead or failing trainer rank ends the run in one line."""
    calls = []
    for rank, t in enumerate(ranks.trainers):
        try:
            calls.append(t.submit(command))
        except KvmoveError as exc:
            raise _fatal(ranks, step, rank, exc) from None
    deadline = time.monotonic() + ranks.config.deadline_s
    out = []
    for call in calls:
        if not ranks.launcher.wait([call], max(0.0, deadline - time.monotonic())):
            raise RunFailed(f"{call.label} did not answer within {ranks.config.deadline_s:.0f} s")
        out.append(_trainer_result(ranks, step, call))
    return out


def _engine_failed(ranks: RunningRanks, step: Step, rank: int, exc: KvmoveError) -> None:
    if rank in step.engine_deaths:
        n, total = step.engine_deaths[rank], _pull_count(ranks, step, rank)
        step.ctx.pulls_before_kill[rank] = n
        replica = ranks.config.engine.coord(rank).replica
        why = f"replica {replica} killed during sync {step.index}: engine rank {rank} after {n} of {total} pulls"
    else:
        why = f"engine rank {rank} failed: {str(exc).splitlines()[0][:300]}"
    _drop_replica(ranks, step, rank, why)


def _pull_count(ranks: RunningRanks, step: Step, rank: int) -> int:
    pulls = ranks.blueprint.pulls.get(step.strategy.name)
    return len(pulls[rank].pulls) if pulls else 0


def _missed_deadline(ranks: RunningRanks, step: Step, pending: dict[Call, tuple[Side, int]]) -> None:
    late = sorted(rank for side, rank in pending.values() if side is Side.ENGINE)
    for e in late:
        _drop_replica(ranks, step, e, f"engine rank {e} missed the {ranks.config.deadline_s:.0f} s deadline")
    trainers = sorted(rank for side, rank in pending.values() if side is Side.TRAINER)
    if trainers:
        raise RunFailed(f"trainer rank {trainers[0]} did not finish sync {step.index} within the deadline")


def _drop_replica(ranks: RunningRanks, step: Step, engine: int, why: str) -> None:
    """Take ``engine``'s whole replica out of this sync: kill what is left of it, tell every trainer rank."""
    replica = ranks.config.engine.coord(engine).replica
    if replica in step.dropped:
        return
    step.dropped.add(replica)
    step.ctx.notes.append(why + f"; replica {replica} dropped from this sync")
    ranks.kill_replica(replica)
    for e in ranks.replica_ranks(replica):
        for t in ranks.trainers:
            with contextlib.suppress(RankDied):  # a dead trainer rank is reported by its own call
                step.background.append(t.submit(EngineGone(step.sync_id, e)))


# -- commit ----------------------------------------------------------------------------------------------------
def commit(ranks: RunningRanks, step: Step, outcome: Outcome) -> SyncResult:
    """Verify the live engine ranks (if asked), then the result."""
    c = ranks.config
    for call in step.background:  # notes to trainer ranks; their replies (None) only free the connections
        if ranks.launcher.wait([call], c.deadline_s):
            with contextlib.suppress(KvmoveError):
                ranks.launcher.result(call)
    verified = _verify(ranks, step) if c.verify else None
    _record_synced(ranks, step, outcome, verified)
    step.ctx.dead_replicas = tuple(sorted(ranks.dead_replicas()))
    trainers = [outcome.trainers[r] for r in sorted(outcome.trainers)]
    return build_result(
        step.ctx,
        step.strategy,
        step.index,
        outcome.seconds,
        verified,
        outcome.engines,
        trainers,
        outcome.done_at,
        outcome.cpu_seconds,
    )


def delta_bases(ranks: RunningRanks, step: Step) -> dict[int, int]:
    """Delta syncs: the live engine ranks a pull may be encoded against, with the sync whose weights each holds
    (none in a full sync: every ``full_every``-th of the strategy)."""
    every = ranks.config.full_every
    if every and step.index % every == 0:
        step.ctx.notes.append(f"full sync (every {every}th): dense, images refreshed")
        return {}
    return {e: ranks.synced[e] for e in step.live if e in ranks.synced}


def _record_synced(ranks: RunningRanks, step: Step, outcome: Outcome, verified: Verification | None) -> None:
    """Which sync's weights each engine rank holds now: this one for those that finished it (and verified, where
    checked); unknown for the rest (dropped, dead, mismatched), whose next sync is then dense."""
    bad = set(verified.ranks) if verified is not None else set()
    for e in range(ranks.config.engine.world):
        if e in outcome.engines and e not in ranks.dead and e not in bad:
            ranks.synced[e] = step.sync_id
        else:
            ranks.synced.pop(e, None)


def _verify(ranks: RunningRanks, step: Step) -> Verification:
    live = ranks.live_engines()
    calls = [ranks.engines[e].submit(VerifyWeights(step.version, ranks.config.seed)) for e in live]
    results = ranks.launcher.gather(calls, ranks.config.deadline_s + 300)
    bad = tuple(f"engine rank {e}: {m}" for e, r in zip(live, results, strict=True) for m in r.mismatches[:3])
    differing = tuple(e for e, r in zip(live, results, strict=True) if not r.ok)
    return Verification(not differing if live else None, differing, bad)
