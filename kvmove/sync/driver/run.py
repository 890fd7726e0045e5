"""A run of syncs: check the config, start the ranks with its launcher, init once, then every sync."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvmove.sync.config import SyncConfig
from kvmove.sync.driver.checks import checked
from kvmove.sync.driver.faults import FaultHooks
from kvmove.sync.driver.result import SyncResult
from kvmove.sync.driver.running import RunningRanks
from kvmove.sync.driver.step import run_sync
from kvmove.sync.launchers import get_launcher

Progress = Callable[[str], None]


def start(config: SyncConfig, progress: Progress | None = None) -> RunningRanks:
    """Check ``config`` (before anything starts), start its ranks and run the five-step init."""
    config = checked(config)
    say = progress or (lambda _m: None)
    launcher = get_launcher(config.placement.launcher)(config)
    say(f"starting {config.trainer.world} trainer and {config.engine.world} engine ranks ({config.placement.launcher})")
    try:
        return RunningRanks(config, launcher)
    except BaseException:
        launcher.close()
        raise


def run_syncs(config: SyncConfig, progress: Progress | None = None) -> Iterator[SyncResult]:
    """Start the ranks, then ``config.syncs`` syncs of each strategy; one result per (strategy, sync)."""
    ranks = start(config, progress)
    say, hooks = progress or (lambda _m: None), FaultHooks(config.faults, config.engine)
    try:
        sync_id = 0
        for strategy in config.strategies:
            for index in range(1, config.syncs + 1):
                sync_id += 1
                say(f"{strategy.name}: sync {index}/{config.syncs}")
                yield run_sync(ranks, hooks, strategy, index, sync_id)
    finally:
        ranks.close()
