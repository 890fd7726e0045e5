"""Sync strategies (a registry): how the trainer materializes tensors and who serves each engine region."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.errors import KvmoveError


@dataclass(frozen=True)
class Strategy:
    """A way to sync; ``scope`` says which trainer ranks hold full tensors when engine ranks pull."""

    name: str
    scope: str
    summary: str


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("v1", "global", "gather every tensor over TP/PP/EP, one at a time; engine ranks pull slices"),
        Strategy("v2", "stage", "gather inside each pipeline stage only; experts pulled from their EP owner"),
        Strategy("v3", "stage", "v2 pipelined by groups of decoder blocks with bounded buffers"),
        Strategy(
            "broadcast",
            "root",
            "baseline: full tensors gathered on rank 0 and broadcast to every engine rank",
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
