"""The raw gloo broadcast a CPU sync run measures for its broadcast group (kvmove.bench.rawcast)."""

from __future__ import annotations

import threading

import pytest

from kvmove.bench.rawcast import measure_broadcast, time_member
from kvmove.errors import KvmoveError
from kvmove.ports import free_port
from kvmove.sync.ranks.control import Address, BroadcastGroup


def test_members_time_broadcasts_into_fresh_buffers() -> None:
    """Three members of one gloo group (threads here; Ray actors in the suite): every member times each broadcast
    after a warm-up, and receivers check the bytes arrived."""
    group = BroadcastGroup(Address("127.0.0.1", free_port()), 3, "raw-test")
    out: dict[int, list[float]] = {}

    def run(member: int) -> None:
        out[member] = time_member(group, member, 1 << 16, 3, timeout_s=60)

    threads = [threading.Thread(target=run, args=(m,)) for m in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(out) == [0, 1, 2] and all(len(v) == 3 and min(v) > 0 for v in out.values())


def test_a_broadcast_of_one_member_is_refused_in_one_line() -> None:
    with pytest.raises(KvmoveError, match="at least 2 members"):
        measure_broadcast(1)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_the_suite_measures_the_broadcast_among_ray_actors() -> None:
    from kvmove.bench.syncs import broadcast_row

    row = broadcast_row(3)
    assert row.name == "raw gloo broadcast x3" and row.suite == "transport" and row.gbps > 0
    assert row.extra["members"] == 3 and row.bytes == 64 << 20
