"""Sync strategies (a registry). A :class:`Strategy` carries its behaviour, so no code outside this module asks
for a strategy by name: how the trainer gathers (:class:`Gather`), how tensors are grouped (:class:`Grouping`),
how bytes reach the engines (:class:`Delivery`), whether direct pulls are allowed, and how much it overlaps
(:class:`Overlap`: requests in flight, receive slots, background loads, gathering ahead).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmove.errors import KvmoveError


class Gather(enum.StrEnum):
    """Which trainer ranks hold full tensors once the strategy's gather ran (the *scope* of the gather)."""

    GLOBAL = "global"
    """Every rank gathers every tensor over TP/PP/EP (every rank takes part in every tensor's collective)."""
    STAGE = "stage"
    """Ranks gather inside their pipeline stage only (TP, and ETP for experts); experts stay with their EP owner."""
    ROOT = "root"
    """Rank 0 gathers everything (every rank takes part, only rank 0 ends up holding)."""

    @property
    def every_rank_joins(self) -> bool:
        """Whether every trainer rank takes part in the collective of every tensor (not only its holders)."""
        return self is not Gather.STAGE


class Grouping(enum.StrEnum):
    """How tensors form *groups*: the unit of gather, transfer and release (``planning.schedule.tensor_groups``)."""

    TENSOR = "tensor"
    """One group per tensor (the simple iterator)."""
    STAGE = "stage"
    """One group per trainer pipeline stage."""
    BLOCKS = "blocks"
    """One group per ``SyncOptions.group_size`` decoder blocks (plus embedding and head groups)."""


class Delivery(enum.StrEnum):
    """How bytes reach the engine ranks."""

    PULL = "pull"
    """Every engine rank pulls exactly its regions from the trainer ranks that hold them."""
    BROADCAST = "broadcast"
    """Trainer rank 0 broadcasts every full tensor to every engine rank, which loads it with its own loader."""


@dataclass(frozen=True)
class Overlap:
    """How much of a sync runs concurrently (all zero/False: strictly one pull after another)."""

    requests_ahead: int = 0
    """Packed pulls an engine rank requests beyond the one it is reading (the trainer packs while it reads)."""
    receive_slots: int = 1
    """Engine receive buffers for packed pulls (2: load group g while group g+1 is read)."""
    background_load: bool = False
    """Engine ranks copy received bytes into parameters on a loader thread, overlapping the next read."""
    serve_slots_per_engine: int = 1
    """Trainer serve slots per consuming engine rank (more: packs ahead of reads)."""
    gather_ahead: bool = False
    """Trainer ranks gather up to ``SyncOptions.lookahead`` groups ahead of the oldest unreleased one."""
    direct_ahead: bool = False
    """Engine ranks start every direct pull of the sync at once and keep them in flight during the packed pulls
    (otherwise each direct pull is read, as one batch, in its group's turn)."""
    interleave: bool = False
    """Engine ranks alternate packed pulls between trainer ranks (pipeline stages pack at once, not in turn)."""


@dataclass(frozen=True)
class Strategy:
    """A way to sync (see the module docstring); ``name`` is its registry key and label, never compared."""

    name: str
    summary: str
    scope: Gather
    grouping: Grouping
    delivery: Delivery = Delivery.PULL
    direct: bool = False
    """Regions lying in a trainer rank's raw shard may be read straight from its arena (needs STAGE scope)."""
    overlap: Overlap = field(default_factory=Overlap)

    @property
    def pulls(self) -> bool:
        """Whether engine ranks pull their regions (a pull plan exists for this strategy)."""
        return self.delivery is Delivery.PULL

    def lookahead(self, requested: int) -> int:
        """Groups a trainer rank may gather ahead, given the ``--lookahead`` the user asked for."""
        return requested if self.overlap.gather_ahead else 0

    def recv_slots(self) -> int:
        return self.overlap.receive_slots

    def serve_slots(self, consumers: int, cap: int) -> int:
        """Serve slots a trainer rank registers for ``consumers`` engine ranks (at most ``cap``, at least 1)."""
        return max(1, min(cap, consumers * self.overlap.serve_slots_per_engine))


PIPELINED = Overlap(
    requests_ahead=1,
    receive_slots=2,
    background_load=True,
    serve_slots_per_engine=2,
    gather_ahead=True,
    direct_ahead=True,
    interleave=True,
)

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "v1",
            "gather every tensor over TP/PP/EP, one at a time; engine ranks pull slices",
            Gather.GLOBAL,
            Grouping.TENSOR,
        ),
        Strategy(
            "v2",
            "gather inside each pipeline stage only; experts pulled from their EP owner",
            Gather.STAGE,
            Grouping.STAGE,
            direct=True,
        ),
        Strategy(
            "v3",
            "v2 pipelined by groups of decoder blocks with bounded buffers",
            Gather.STAGE,
            Grouping.BLOCKS,
            direct=True,
            overlap=PIPELINED,
        ),
        Strategy(
            "broadcast",
            "baseline: full tensors gathered on rank 0 and broadcast to every engine rank",
            Gather.ROOT,
            Grouping.TENSOR,
            delivery=Delivery.BROADCAST,
        ),
    )
}


def parse_strategies(text: str) -> list[Strategy]:
    """``"v1,v3"`` -> strategies, in the given order; unknown names are a KvmoveError."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise KvmoveError(
            f"unknown strategy {', '.join(map(repr, unknown)) or repr(text)} (known: {', '.join(STRATEGIES)})"
        )
    return [STRATEGIES[n] for n in names]
