"""Placement (pure planning): which ranks share a device.

A :class:`DeviceMap` names the device of every trainer and engine rank by a *key*: two ranks on one device have
one key (a GPU's key is its device, ``cuda:N``). CPU ranks have no device to share, so each gets a key of its
own, except where the placement is colocated: engine rank i then shares trainer rank i's key (the CPU twin of
trainer and engine ranks sharing GPUs). Routing prefers a trainer rank on the engine rank's own device
(``is_local``), and ``kvmove.sync.planning.ceiling`` splits a sync's bytes by device and link with it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from kvmove.sync.config import Placement


class DeviceMap(NamedTuple):
    """Device keys of trainer ranks (``trainer[r]``) and engine ranks (``engine[e]``)."""

    trainer: tuple[str, ...]
    engine: tuple[str, ...]

    @classmethod
    def of(cls, placement: Placement, trainers: int, engines: int) -> DeviceMap:
        return cls(
            tuple(_key(placement.trainer_device(r), f"t{r}", placement, r, trainers) for r in range(trainers)),
            tuple(_key(placement.engine_device(e), f"e{e}", placement, e, trainers) for e in range(engines)),
        )

    def is_local(self, engine: int, trainer: int) -> bool:
        """Whether ``engine`` reads ``trainer``'s bytes without leaving its device."""
        return self.engine[engine] == self.trainer[trainer]

    def shared(self) -> dict[str, tuple[list[int], list[int]]]:
        """Keys held by more than one rank: key -> (trainer ranks, engine ranks) on that device."""
        out: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for r, k in enumerate(self.trainer):
            out[k][0].append(r)
        for e, k in enumerate(self.engine):
            out[k][1].append(e)
        return {k: v for k, v in out.items() if len(v[0]) + len(v[1]) > 1}


def _key(device: str, own: str, placement: Placement, rank: int, trainers: int) -> str:
    if device.startswith("cuda"):
        return device if ":" in device else "cuda:0"
    return f"cpu#{rank % trainers}" if placement.colocated else f"cpu:{own}"
