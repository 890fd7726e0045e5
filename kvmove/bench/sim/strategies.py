"""The strategies the simulator prices: the planner's own registry (``kvmove.sync.strategies``), read as data.

Each :class:`SimStrategy` is a planner :class:`~kvmove.sync.strategies.Strategy` seen through the four facts the
pricing needs (its grouping, its gather scope, whether it broadcasts, whether its phases overlap, whether engine
ranks start their direct and mapped pulls at once), so the
simulator keeps no second list of what v1/v2/v3/broadcast do. One more strategy is priced that kvmove does not
run: ``broadcast-pipelined``, MoonshotAI checkpoint-engine's bucketed host-to-device + broadcast pipeline, built as
a planner ``Strategy`` value so its published figures can be simulated as the setup they describe.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.errors import KvmoveError
from kvmove.sync.strategies import PIPELINED, STRATEGIES, Delivery, Gather, Grouping, Strategy

GROUPING = {Grouping.TENSOR: "tensor", Grouping.STAGE: "stage", Grouping.BLOCKS: "layer"}
"""The planner's grouping -> the simulator's unit of gather, transfer and release."""

PUBLISHED_ONLY = (
    Strategy(
        "broadcast-pipelined",
        "full tensors per decoder block, loaded and broadcast overlapped (MoonshotAI checkpoint-engine)",
        Gather.ROOT,
        Grouping.BLOCKS,
        delivery=Delivery.BROADCAST,
        overlap=PIPELINED,
    ),
)


@dataclass(frozen=True)
class SimStrategy:
    """``grouping``: the unit of gather, transfer and release ("tensor", "stage" or "layer");
    ``scope``: which trainer ranks hold a full tensor when engine ranks read it ("global": every rank;
    "stage": the ranks of its pipeline stage, experts only their expert-parallel owners; "root": one rank
    broadcasts it); ``pipelined``: groups flow through the phases overlapped, with bounded buffers; ``ahead``:
    engine ranks start every direct and mapped pull at the sync's start (``Overlap.direct_ahead``), so mapped
    pulls' quantizations run beside everything else on a stream of their own."""

    name: str
    grouping: str
    scope: str
    pipelined: bool
    summary: str
    ahead: bool = False

    @property
    def broadcast(self) -> bool:
        return self.scope == "root"

    @classmethod
    def of(cls, s: Strategy) -> SimStrategy:
        """The planner strategy ``s`` as the pricing reads it."""
        broadcast = s.delivery is Delivery.BROADCAST
        if broadcast != (s.scope is Gather.ROOT):
            raise KvmoveError(f"strategy {s.name}: the simulator prices broadcasts from a root gather only")
        return cls(
            s.name, GROUPING[s.grouping], s.scope.value, s.overlap.gather_ahead, s.summary, s.overlap.direct_ahead
        )


SIM_STRATEGIES: dict[str, SimStrategy] = {s.name: SimStrategy.of(s) for s in (*STRATEGIES.values(), *PUBLISHED_ONLY)}


def parse_sim_strategies(text: str) -> list[SimStrategy]:
    """``"v1,v3"`` (or ``all``) -> strategies in order; unknown names are a KvmoveError."""
    names = list(SIM_STRATEGIES) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIM_STRATEGIES]
    if unknown or not names:
        raise KvmoveError(
            f"unknown strategy {', '.join(map(repr, unknown)) or repr(text)} (known: {', '.join(SIM_STRATEGIES)}, all)"
        )
    return [SIM_STRATEGIES[n] for n in names]
