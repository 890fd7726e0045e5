"""The starving-high-priority policy: a pure function of /metrics."""

from __future__ import annotations

import pytest

from kvmove.migration.policy import WorkerView, get_policy, starving_high_priority
from kvmove.server.messages import Metrics


def _view(url: str, free: int, waiting: dict[str, list[str]]) -> WorkerView:
    met = Metrics(
        waiting_per_priority={p: len(r) for p, r in waiting.items()},
        waiting_rids=waiting,
        running=1,
        running_rids=[],
        held_rids=[],
        free_pages=free,
        used_pages=64 - free,
        cached_pages=0,
        total_pages=64,
        page_size=16,
        host_free_pages=64,
        migrations_pending=0,
        weight_version="0",
    )
    return WorkerView(url, met)


@pytest.mark.parametrize(
    ("waiting", "idle_free", "expected"),
    [
        ({"10": ["h1", "h2"]}, 64, ["h1", "h2"]),
        ({"10": ["h1", "h2"]}, 5, ["h1"]),  # room for one only
        ({"0": ["l1"]}, 64, []),  # low priority stays
        ({"10": ["h1"], "0": ["l1"]}, 2, []),  # no room anywhere
    ],
)
def test_moves_high_priority_waiting_on_a_full_worker(waiting, idle_free: int, expected: list[str]) -> None:
    plan = starving_high_priority([_view("busy", 0, waiting), _view("idle", idle_free, {})], 10, 4)
    assert [d.rid for d in plan] == expected
    assert all((d.source, d.target) == ("busy", "idle") for d in plan)


def test_worker_with_room_keeps_its_queue() -> None:
    assert starving_high_priority([_view("a", 10, {"10": ["h"]}), _view("b", 64, {})], 10, 4) == []
    assert get_policy("starving-high-priority") is starving_high_priority
