"""The simulated sync strategies (a registry): how tensors are grouped, who serves them, whether phases overlap.

``v1``/``v2``/``v3``/``broadcast`` are the four the project runs for real (``kvmove sync-weights``);
``broadcast-pipelined`` is the bucketed host-to-device + broadcast pipeline of MoonshotAI's checkpoint-engine,
kept so its published figures can be simulated as the setup they describe.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.errors import KvmoveError


@dataclass(frozen=True)
class SimStrategy:
    """``grouping``: the unit of gather, transfer and release ("tensor", "stage" or "layer");
    ``scope``: which trainer ranks hold a full tensor when engine ranks read it ("global": every rank;
    "stage": the ranks of its pipeline stage, experts only their expert-parallel owners; "root": one rank
    broadcasts it); ``pipelined``: groups flow through the phases overlapped, with bounded buffers."""

    name: str
    grouping: str
    scope: str
    pipelined: bool
    summary: str

    @property
    def broadcast(self) -> bool:
        return self.scope == "root"


SIM_STRATEGIES: dict[str, SimStrategy] = {
    s.name: s
    for s in (
        SimStrategy("v1", "tensor", "global", False, "every tensor gathered over all trainer ranks, one at a time"),
        SimStrategy("v2", "stage", "stage", False, "one group per pipeline stage; experts read from their owner"),
        SimStrategy("v3", "layer", "stage", True, "v2 per decoder block, pipelined with bounded buffers"),
        SimStrategy("broadcast", "tensor", "root", False, "full tensors broadcast to every engine rank (NCCL)"),
        SimStrategy(
            "broadcast-pipelined",
            "layer",
            "root",
            True,
            "full tensors per decoder block, loaded and broadcast overlapped (checkpoint-engine)",
        ),
    )
}


def parse_sim_strategies(text: str) -> list[SimStrategy]:
    """``"v1,v3"`` (or ``all``) -> strategies in order; unknown names are a KvmoveError."""
    names = list(SIM_STRATEGIES) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIM_STRATEGIES]
    if unknown or not names:
        raise KvmoveError(
            f"unknown strategy {', '.join(map(repr, unknown)) or repr(text)} (known: {', '.join(SIM_STRATEGIES)}, all)"
        )
    return [SIM_STRATEGIES[n] for n in names]
