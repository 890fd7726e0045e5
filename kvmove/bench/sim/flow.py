"""How a sync's steps flow through its phases (gather, pack, transfer, load, relay hops), given each phase's seconds
per step (``kvmove.bench.sim.pricing``'s phase table): one update whose stages take turns, or a flow shop with
bounded buffers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvmove.bench.sim.setup import SimSetup


def one_update(table: np.ndarray, stage: np.ndarray) -> float:
    """Each pipeline stage prepares (gathers, packs) its next group once its previous one has landed; the engines
    take one group at a time (transfer, load, relays), in the order the stages offer them."""
    prepare, deliver = table[:2].sum(axis=0), table[2:].sum(axis=0)
    ready: dict[int, float] = {}
    engine = 0.0
    seen: dict[int, int] = {}
    turn = []
    for k in stage:  # the stages offer their groups in turn
        seen[int(k)] = seen.get(int(k), -1) + 1
        turn.append(seen[int(k)])
    for g in sorted(range(len(stage)), key=lambda g: (turn[g], int(stage[g]))):
        k = int(stage[g])
        start = max(ready.get(k, 0.0) + prepare[g], engine)
        ready[k], engine = start + table[2, g], start + deliver[g]  # the stage goes on once its bytes have landed
    return engine


def flow_shop(table: np.ndarray, s: SimSetup) -> float:
    """Makespan of steps through the phases, each phase one server, with bounded buffers."""
    phases, n = table.shape
    done = np.zeros((phases, n))
    for g in range(n):
        for p in range(phases):
            start = max(done[p - 1, g] if p else 0.0, done[p, g - 1] if g else 0.0)
            if p == 0 and g > s.lookahead:
                start = max(start, done[2, g - s.lookahead - 1])  # gather waits for a group's release
            if p == 2 and g >= s.num_buffers:
                start = max(start, done[3, g - s.num_buffers])  # a receive slot frees once its group is loaded
            done[p, g] = start + table[p, g]
    return float(done[:, -1].max()) if n else 0.0
