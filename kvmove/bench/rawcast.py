"""The raw broadcast of a CPU sync's broadcast group: its line rate, measured in the sync suite's own run.

kvmove's broadcast between CPU processes moves its bytes with gloo over TCP loopback
(``kvmove.sync.ranks.broadcast``): trainer rank 0 and every engine rank in one group, each engine rank receiving
into a buffer it allocates per tensor. That path is not the raw NIXL read the suite measures for pulls, and on a
shared host it is several times slower, so the simulator prices a CPU broadcast's bytes at this figure
(``kvmove.bench.sim.measure``): the same group size, the same gloo group, a fresh receive buffer per broadcast,
timed on the root as ``send_all`` times its calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

import torch

from kvmove.errors import KvmoveError
from kvmove.ports import free_port
from kvmove.sync.ranks.broadcast import open_group
from kvmove.sync.ranks.control import Address, BroadcastGroup

RAW_BROADCAST_BYTES = 64 << 20


class BroadcastResult(NamedTuple):
    """The root's median time per broadcast of ``nbytes`` to ``members - 1`` receivers (after one untimed one)."""

    members: int
    nbytes: int
    repeats: int
    seconds: float
    gb_per_s: float
    """``nbytes`` / ``seconds``: bytes of the tensor per second, whatever the number of receivers."""


def time_member(group: BroadcastGroup, member: int, nbytes: int, repeats: int, timeout_s: float = 120.0) -> list[float]:
    """One member's timed broadcasts (member 0 roots them; the others receive into a fresh buffer each time, as
    ``receive_all`` does); seconds per broadcast, the first (untimed warm-up) dropped."""
    opened = open_group(group, member, "cpu", timeout_s)
    data = torch.full((nbytes,), 7, dtype=torch.uint8) if member == 0 else None
    times = []
    for _ in range(repeats + 1):
        buf = data if data is not None else torch.empty(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        opened.group.broadcast(buf, 0).wait()
        times.append(time.perf_counter() - t0)
    if data is None and int(buf[-1]) != 7:
        raise KvmoveError(f"raw broadcast: member {member} received other bytes than the root sent")
    return times[1:]


class _Member:
    """A Ray actor holding one member of the group."""

    def run(self, group: BroadcastGroup, member: int, nbytes: int, repeats: int) -> list[float]:
        return time_member(group, member, nbytes, repeats)


def measure_broadcast(members: int, nbytes: int = RAW_BROADCAST_BYTES, repeats: int = 5) -> BroadcastResult:
    """Time ``repeats`` gloo broadcasts of ``nbytes`` among ``members`` fresh Ray actors on the running Ray session
    (the root's median), the kind of process a sync's ranks are."""
    if members < 2:
        raise KvmoveError(f"a broadcast needs at least 2 members, got {members}")
    import ray

    if not ray.is_initialized():
        raise KvmoveError("measure_broadcast needs a running Ray session: call ray.init first")
    host = "127.0.0.1"
    group = BroadcastGroup(Address(host, free_port(host)), members, "raw-broadcast")
    actor = ray.remote(num_cpus=0)(_Member)
    actors: list[Any] = [actor.remote() for _ in range(members)]
    try:
        times = ray.get([a.run.remote(group, m, nbytes, repeats) for m, a in enumerate(actors)])
    finally:
        for a in actors:
            ray.kill(a)
    seconds = statistics.median(times[0])
    return BroadcastResult(members, nbytes, repeats, seconds, nbytes / seconds / 1e9)
