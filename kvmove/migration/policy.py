"""Migration policies: which waiting request moves from which worker to which. Pure functions of /metrics.

A policy returns a plan (a list of ``Decision``) and never moves bytes; the controller executes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvmove.errors import KvmoveError
from kvmove.server.messages import Metrics


class WorkerView(NamedTuple):
    url: str
    metrics: Metrics


class Decision(NamedTuple):
    rid: str
    source: str
    target: str
    reason: str


Policy = Callable[[Sequence[WorkerView], int, int], list[Decision]]
"""``(workers, min_priority, pages_needed) -> decisions``."""


def starving_high_priority(workers: Sequence[WorkerView], min_priority: int, pages_needed: int) -> list[Decision]:
    """Move every request of priority >= ``min_priority`` waiting on a worker with no free pages to the worker
    with the most free pages (at least ``pages_needed`` of them, counting the ones already planned)."""
    free = {w.url: w.metrics.free_pages for w in workers}
    plan: list[Decision] = []
    for w in workers:
        if w.metrics.free_pages >= pages_needed:
            continue
        for prio, rids in w.metrics.waiting_rids.items():
            if int(prio) < min_priority:
                continue
            for rid in rids:
                target = max((u for u in free if u != w.url), key=lambda u: free[u], default=None)
                if target is None or free[target] < pages_needed:
                    return plan
                free[target] -= pages_needed
                plan.append(Decision(rid, w.url, target, f"priority {prio} waits on {w.url} under KV pressure"))
    return plan


POLICIES: dict[str, Policy] = {"starving-high-priority": starving_high_priority}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise KvmoveError(f"unknown migration policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name]
