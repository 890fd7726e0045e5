"""Per-group traffic of one strategy on one setup: bytes and operations on every trainer and engine rank.

Built (``kvmove.bench.sim.builder``) from the model's tensor table (``kvmove.models``), the layouts
(``kvmove.models.layout``) and the split rules of ``kvmove.bench.sim.shards``; topology-free and cost-free (``pricing``
turns it into seconds). Engine arrays are for one replica's ranks (replicas are identical); trainer arrays hold
what one replica's demand costs the trainer (the pricing multiplies by the replicas the trainer serves). Demands
spread evenly over the ranks that can serve them (the project's router balances bytes; its dry run reports
busiest/mean). Experts of a layer are handled as one block per projection, and ``tensor`` grouping keeps one
representative per kind of tensor with its multiplicity, so Kimi K2 with 16 replicas stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmove.bench.sim.strategies import SimStrategy
from kvmove.sync.delta.detect import REGION_CLASSES

TRAINER_KEYS = ("send", "pack", "regions", "calls", "yield", "h2d", "quant")
ENGINE_KEYS = (
    "recv", "kept", "scatter", "regions", "direct", "pulls", "direct_pulls", "quant", "layer_bytes", "mapped",
    "mapped_kept",
    *(f"recv.{c}" for c in REGION_CLASSES),
)  # fmt: skip
"""``mapped``: BF16 bytes an engine rank quantizes itself from a trainer rank's mapped arena (mapped pulls:
``kvmove.bench.sim.mapped``), kept (``mapped_kept``: the FP8 bytes they land) but neither received nor landed
from a receive slot. ``recv.CLASS``: the received bytes of one region class (``kvmove.sync.delta.detect``), for
delta pricing."""


@dataclass(frozen=True, eq=False)
class Traffic:
    """Per group ``g`` (occurring ``count[g]`` times): trainer arrays [G, trainer world], engine arrays
    [G, ranks per replica], collectives by size, and the layers whose reload completes in the group."""

    strategy: SimStrategy
    count: np.ndarray
    stage: np.ndarray
    layers: np.ndarray
    t: dict[str, np.ndarray]
    e: dict[str, np.ndarray]
    gather: dict[int, tuple[np.ndarray, np.ndarray]]
    max_request: np.ndarray

    @property
    def groups(self) -> int:
        return len(self.count)

    def total(self, side: str, key: str) -> np.ndarray:
        """Per rank, ``key`` summed over the sync (every group times its count)."""
        arrays = self.t if side == "trainer" else self.e
        return np.asarray((arrays[key] * self.count[:, None]).sum(axis=0))

    @property
    def kept_per_replica(self) -> float:
        """Wire bytes one replica's ranks keep."""
        return float(self.total("engine", "kept").sum())

    @property
    def moved_per_replica(self) -> float:
        """Wire bytes one replica's ranks receive, plus the FP8 bytes they land from mapped arenas (a sync's bytes
        moved, as its copy executors count them: ``mapped-quantize`` next to the transport's)."""
        return self.received_per_replica + float(self.total("engine", "mapped_kept").sum())

    @property
    def received_per_replica(self) -> float:
        """Wire bytes one replica's ranks receive (broadcast: full tensors on every rank)."""
        return float(self.total("engine", "recv").sum())
