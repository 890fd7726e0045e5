"""Mapped pulls in the simulator's terms: which engine ranks quantize a trainer-side FP8 cover themselves, straight
from the serving trainer rank's arena mapped on their own device, instead of pulling it packed, and what that costs.

The rules are the planner's (``kvmove.sync.planning.schedule.pull_plans``, ``docs/notes/fp8.md``), not restated
here: the transport maps peers (``Transport.maps_peers`` of the registry's transport of that name), the engine rank
shares the trainer rank's device (``DeviceMap.is_local`` of the setup's placement) and the entry is mappable
(``entries.mappable``: a ``trainer`` cover read from one raw shard). The simulator's engine arrays are one
replica's ranks; they are placed as replica 0's (engine rank ``k`` on trainer rank ``k``'s GPU when colocated).

A mapped pull moves nothing over a link and the trainer neither gathers nor packs it: the engine reads the BF16
cover (2 B per weight) and writes FP8 and scales (about 1 B), at the quantize rate of the cost book. With
``Overlap.direct_ahead`` (v3) every mapped pull is queued at the sync's start on a stream of its own, beside the
direct reads and any packed pulls; otherwise each runs in its turn, in its group's load.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvmove.bench.sim.costs import QUANTIZE_TRAFFIC, CostBook
from kvmove.bench.sim.setup import SimSetup
from kvmove.bench.sim.traffic import Traffic
from kvmove.sync.config import Placement
from kvmove.sync.planning.entries import PLAIN, TRAINER, Entry, mappable
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.plan import Box


def _flag(transport: str, name: str) -> bool:
    """The registry's class flag ``name`` of the sync transport of this name (False for the simulator's generic
    ``pull`` and ``push``, which name no transport of the registry: NIXL-like 1-D reads that map nothing)."""
    from kvmove.transport import TRANSPORTS

    cls = TRANSPORTS.get(transport)
    return cls is not None and bool(getattr(cls, name))


def maps_peers(transport: str) -> bool:
    """Whether the sync transport of this name maps a peer's registered buffers."""
    return _flag(transport, "maps_peers")


def strided_reads(transport: str) -> bool:
    """Whether the sync transport of this name reads 2-D copies."""
    return _flag(transport, "strided")


def mapping_key(s: SimSetup) -> tuple[object, ...]:
    """What of ``s`` beyond its model, layouts and sync options decides its mapped pulls (for caching traffic)."""
    return maps_peers(s.transport), s.placement, _trainer_gpus(s)


def _trainer_gpus(s: SimSetup) -> int:
    return min(s.trainer.world, s.trainer_nodes * s.cluster.gpus_per_node)


def device_map(s: SimSetup) -> DeviceMap:
    """The devices of the setup's trainer ranks and one replica's engine ranks, as the planner keys them: trainer
    ranks fill the trainer's GPUs in order (all on one GPU on a one-GPU node), engine ranks share trainer rank
    ``k``'s GPU when colocated and have GPUs of their own otherwise."""
    gpus = _trainer_gpus(s)
    trainer = tuple(f"cuda:{i}" for i in range(gpus))
    engine = tuple(f"cuda:{gpus + i}" for i in range(s.engine.world))
    placement = Placement(trainer_devices=trainer, engine_devices=engine, colocated=s.placement == "colocated")
    return DeviceMap.of(placement, s.trainer.world, s.engine.world)


def entry(name: str, shape: tuple[int, ...], trainer_quantizes: bool, shard: bool) -> Entry:
    """The planner's entry of a tensor as the simulator sees it: a ``trainer`` cover where the trainer would
    quantize it (else a plain region), read from one raw shard (``shard``) or from the gathered tensor."""
    box = Box(tuple(0 for _ in shape), tuple(shape))
    return Entry(TRAINER if trainer_quantizes else PLAIN, name, box, (), (), (), shard=shard)


class Mapper:
    """Which engine ranks of one replica map which trainer ranks' arenas, for one setup."""

    def __init__(self, s: SimSetup) -> None:
        self.devices = device_map(s) if maps_peers(s.transport) else None

    def mapped(self, e: Entry, keepers: np.ndarray, holders: Callable[[int], np.ndarray]) -> np.ndarray:
        """Mask over ``keepers``: those that quantize ``e`` themselves from a mapped arena, where one of the
        trainer ranks holding their slice (``holders(i)`` for keeper ``i``) is on their device (the router
        prefers that rank)."""
        devices = self.devices
        if devices is None or not mappable(e):
            return np.zeros(len(keepers), dtype=bool)
        local = [any(devices.is_local(int(k), int(h)) for h in holders(i)) for i, k in enumerate(keepers)]
        return np.array(local, dtype=bool)


def ahead_seconds(traffic: Traffic, s: SimSetup, book: CostBook) -> float:
    """Seconds of the busiest engine rank's mapped pulls when they all run from the sync's start on their own
    stream (``SimStrategy.ahead``); 0 otherwise (they are then in each group's load)."""
    if not traffic.strategy.ahead:
        return 0.0
    return float(book.quantize_seconds(traffic.total("engine", "mapped").max(initial=0.0), s.cluster.hbm_rate))


def floor_seconds(traffic: Traffic, s: SimSetup) -> float:
    """The busiest engine rank's mapped quantization at the HBM's line rate: no sync with mapped pulls beats it."""
    return float(traffic.total("engine", "mapped").max(initial=0.0)) * QUANTIZE_TRAFFIC / s.cluster.hbm_rate
