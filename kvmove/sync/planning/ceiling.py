"""A sync's ceiling (pure planning): its payload split into bytes that stay on a device and bytes that cross a link,
per direction (:func:`link_bytes`, from the pull plans and the ``placement.DeviceMap``), and the time no transport
can beat for that split (:func:`ceiling_seconds`, from the device-copy and link rates measured in the same run).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.schedule import PullPlan


class LinkBytes(NamedTuple):
    """A sync's payload by where it travels: ``local[key]`` bytes copied inside device ``key``, ``cross[(src, dst)]``
    bytes over the link from device ``src`` to device ``dst``."""

    local: dict[str, int]
    cross: dict[tuple[str, str], int]

    @property
    def local_max(self) -> int:
        """Bytes the busiest device copies inside itself (devices copy in parallel)."""
        return max(self.local.values(), default=0)

    @property
    def cross_max(self) -> int:
        """Bytes over the busiest link direction (each direction of a link counted once: they run at once)."""
        return max(self.cross.values(), default=0)

    @property
    def total(self) -> int:
        return sum(self.local.values()) + sum(self.cross.values())

    def as_json(self) -> dict[str, int]:
        return {
            "local_bytes": sum(self.local.values()),
            "cross_bytes": sum(self.cross.values()),
            "local_max_bytes": self.local_max,
            "cross_max_bytes": self.cross_max,
        }


def link_bytes(pulls: Iterable[PullPlan], devices: DeviceMap, engines: Sequence[int] | None = None) -> LinkBytes:
    """Split the payload of ``pulls`` (every engine rank, or those in ``engines``) by device and link direction."""
    wanted = None if engines is None else set(engines)
    local: dict[str, int] = defaultdict(int)
    cross: dict[tuple[str, str], int] = defaultdict(int)
    for pp in pulls:
        if wanted is not None and pp.engine not in wanted:
            continue
        dst = devices.engine[pp.engine]
        for p in pp.pulls:
            src = devices.trainer[p.trainer]
            if src == dst:
                local[dst] += p.nbytes
            else:
                cross[(src, dst)] += p.nbytes
    return LinkBytes(dict(local), dict(cross))


def ceiling_seconds(split: LinkBytes, copy_gbps: float, link_gbps: float) -> float:
    """The time no sync of this payload can beat: the busiest device's local bytes at ``copy_gbps`` (bytes copied
    per second, i.e. half a read+write figure) plus the busiest link direction's bytes at ``link_gbps``.

    NOTE: the two are added, not overlapped: a device copying its local bytes and a link writing into the same
    device's memory share that memory's bandwidth, and this is the ceiling the issue states (local bytes at the
    device-copy rate, crossing bytes at the P2P rate, each link direction once).
    """
    return seconds_at(split.local_max, split.cross_max, copy_gbps, link_gbps)


def seconds_at(local_max: int, cross_max: int, copy_gbps: float, link_gbps: float) -> float:
    """:func:`ceiling_seconds` of a split given by its busiest device's and busiest link direction's bytes."""
    local = local_max / (copy_gbps * 1e9) if local_max else 0.0
    cross = cross_max / (link_gbps * 1e9) if cross_max else 0.0
    return local + cross
