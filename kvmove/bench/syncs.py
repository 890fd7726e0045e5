"""Result rows of weight syncs."""

from __future__ import annotations

from kvmove.bench.results import Row
from kvmove.sync.runner import SyncConfig, SyncResult


def sync_row(config: SyncConfig, r: SyncResult, suite: str = "sync") -> Row:
    """One measured row per (strategy, sync)."""
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
        extra={
            "sync": r.sync,
            "verified": r.verified,
            "live_engines": r.live_engines,
            "peak_extra_bytes": r.peak_extra_bytes,
            "dead_replicas": list(r.dead_replicas),
            "group_size": config.options.group_size,
            "lookahead": config.options.lookahead,
        },
    )
