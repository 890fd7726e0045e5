"""Fault injection as hooks at named points of the driver (pure: it says what to do; the sync step does it).

Points: *before sync k* (a replica or trainer rank is killed before the sync starts) and *during sync k* (the
rank's own process dies once half its work of the sync is done: an engine rank after half its pulls finished,
at least one; a trainer rank after half its groups were published). Counting work instead of waiting a time
makes a mid-sync fault land mid-sync whatever the sync's length, on a 20 ms demo sync as on a long one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvmove.models.layout import EngineLayout
from kvmove.sync.config import Fault, Side


class FaultHooks:
    """The run's faults, asked at each named point."""

    def __init__(self, faults: Sequence[Fault], engine: EngineLayout) -> None:
        self.faults, self.engine = tuple(faults), engine

    def before(self, index: int, side: Side) -> list[int]:
        """Replicas (engine side) or trainer ranks killed before sync ``index`` starts."""
        return [f.target for f in self.faults if f.side is side and f.sync == index and not f.during]

    def engine_deaths(self, index: int, live: set[int], work: Mapping[int, int]) -> dict[int, int]:
        """Engine rank -> pulls after which it dies during sync ``index`` (``work``: its pulls in this sync).

        The first live rank of each targeted replica dies; the driver then takes the rest of the replica out.
        """
        out = {}
        for f in self.faults:
            if f.side is Side.ENGINE and f.during and f.sync == index:
                first = f.target * self.engine.ranks_per_replica
                ranks = [e for e in range(first, first + self.engine.ranks_per_replica) if e in live]
                if ranks:
                    out[ranks[0]] = max(1, work.get(ranks[0], 0) // 2)
        return out

    def trainer_deaths(self, index: int, work: Mapping[int, int]) -> dict[int, int]:
        """Trainer rank -> groups after whose publication it dies during sync ``index`` (0: at its start)."""
        return {
            f.target: work.get(f.target, 0) // 2
            for f in self.faults
            if f.side is Side.TRAINER and f.during and f.sync == index
        }
