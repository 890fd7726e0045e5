"""Option aliases shared by commands (one spelling, one help text)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvmove.models import DEFAULT_MODEL

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="Preset name (see `kvmove models list`) or path to an HF config.json."),
]
ModelArg = Annotated[str, typer.Argument(help="Preset name or path to an HF-style config.json.")]
OverrideOpt = Annotated[
    list[str] | None,
    typer.Option("--override", "-o", help="Change a config field, key=value (repeatable)."),
]
TrainerOpt = Annotated[
    str,
    typer.Option("--trainer", help="Trainer layout: tp=..,pp=..,ep=..[,etp=..][,dp=..] (Megatron-style)."),
]
EngineOpt = Annotated[str, typer.Option("--engine", help="One engine's layout: tp=..,dp=..,ep=..[,pp=..].")]
ReplicasOpt = Annotated[int | None, typer.Option("--replicas", help="Number of engine replicas.", min=1)]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object per line instead of a table.")]
StrategyOpt = Annotated[str, typer.Option("--strategy", help="Comma-separated: v1,v2,v3,broadcast.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the random weights used by --verify.")]

DEFAULT_TRAINER = "tp=2,pp=2,ep=2"
DEFAULT_ENGINE = "tp=2,ep=2"
DEFAULT_REPLICAS = 2
__all__ = ["DEFAULT_MODEL"]
