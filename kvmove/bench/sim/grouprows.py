"""The per-group rows a traffic build accumulates (trainer and engine quantities per rank, collectives, sources,
largest request, trainer stage), and one item's share of them, kept to be added again wherever the same kind of
item recurs."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from kvmove.bench.sim.pulls import Source
from kvmove.bench.sim.traffic import ENGINE_KEYS, TRAINER_KEYS


class Contribution(NamedTuple):
    """One item's rows (trainer, engine, collectives), sources, largest request and trainer stage."""

    t: dict[str, np.ndarray]
    e: dict[str, np.ndarray]
    gather: dict[int, tuple[np.ndarray, np.ndarray]]
    sources: tuple[tuple[Source, int], ...]
    """Each source with the jobs it serves."""
    max_request: float
    stage: int


class GroupRows:
    """Per group: each trainer rank's and each engine rank's quantities (``TRAINER_KEYS``, ``ENGINE_KEYS``), the
    collectives each trainer rank runs (by group size: ops and bytes), the sources engine ranks pull from, the
    largest request, the layers completed and the trainer stage."""

    def __init__(self, groups: int, world: int, local: int) -> None:
        self.groups, self.world = groups, world
        self.t = {k: np.zeros((groups, world)) for k in TRAINER_KEYS}
        self.e = {k: np.zeros((groups, local)) for k in ENGINE_KEYS}
        self.gather: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.layers, self.max_request = np.zeros(groups), np.zeros(groups)
        self.stage = np.zeros(groups, dtype=np.int64)
        self.sources: list[Counter[Source]] = [Counter() for _ in range(groups)]

    def collectives(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Ops and bytes of each trainer rank's collectives over ``n`` ranks, per group (created on first use)."""
        if n not in self.gather:
            self.gather[n] = (np.zeros((self.groups, self.world)), np.zeros((self.groups, self.world)))
        return self.gather[n]

    def clear(self) -> None:
        """Group 0 back to nothing (a one-group scratch build, reused item after item)."""
        for arrays in (self.t, self.e):
            for a in arrays.values():
                a.fill(0.0)
        for ops, nbytes in self.gather.values():
            ops.fill(0.0)
            nbytes.fill(0.0)
        self.sources[0].clear()
        self.max_request[0] = 0.0

    def snapshot(self) -> Contribution:
        """Group 0's rows, copied (what one item contributed to a cleared scratch build)."""
        return Contribution(
            {k: a[0].copy() for k, a in self.t.items() if a[0].any()},
            {k: a[0].copy() for k, a in self.e.items() if a[0].any()},
            {n: (ops[0].copy(), nbytes[0].copy()) for n, (ops, nbytes) in self.gather.items() if ops[0].any()},
            tuple(self.sources[0].items()),
            float(self.max_request[0]),
            int(self.stage[0]),
        )

    def apply(self, g: int, c: Contribution) -> None:
        """Add one item's contribution to group ``g``."""
        for k, row in c.t.items():
            self.t[k][g] += row
        for k, row in c.e.items():
            self.e[k][g] += row
        for n, (ops, nbytes) in c.gather.items():
            all_ops, all_bytes = self.collectives(n)
            all_ops[g] += ops
            all_bytes[g] += nbytes
        for source, jobs in c.sources:
            self.sources[g][source] += jobs
        self.max_request[g] = max(self.max_request[g], c.max_request)
        self.stage[g] = c.stage
