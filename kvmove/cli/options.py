"""Option aliases shared by commands (one spelling, one help text), the choices they accept (enums, shown in
``--help``) and the help panels that group them.

Nothing here imports torch, pandas or Ray: ``kvmove --help`` must stay fast. The enums mirror registries that do
import them (transports, engines); tests/cli keep the two equal.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from kvmove.errors import KvmoveError
from kvmove.sync.strategies import STRATEGIES

DEFAULT_MODEL = "qwen3-moe-tiny"  # == kvmove.models.DEFAULT_MODEL (a test keeps them equal)
DEFAULT_TRAINER = "tp=2,pp=2,ep=2"
DEFAULT_ENGINE = "tp=2,ep=2"
DEFAULT_REPLICAS = 2

PANEL_MODEL = "Model and layout"
PANEL_RUN = "Run: real syncs (the default mode)"
PANEL_DRY = "Dry run (--dry-run)"
PANEL_SIM = "Simulate (--simulate)"
PANEL_FAULTS = "Faults (run mode)"
PANEL_TUNING = "Transport tuning (run mode)"
PANEL_OUTPUT = "Output"


class SyncTransport(StrEnum):
    """Byte movers of a weight sync (``auto``: the first available of nixl, rdt-nixl, rdt-gloo, gloo)."""

    auto = "auto"
    nixl = "nixl"
    rdt_nixl = "rdt-nixl"
    rdt_gloo = "rdt-gloo"
    gloo = "gloo"
    nccl = "nccl"
    cuda_ipc = "cuda-ipc"
    object_store = "object-store"


class KVTransport(StrEnum):
    """KV data plane between servers (``auto``: nixl where installed, else http with a warning)."""

    auto = "auto"
    nixl = "nixl"
    http = "http"


class Launcher(StrEnum):
    """How the ranks of a sync are started (``kvmove.sync.launchers``)."""

    ray = "ray"
    processes = "processes"


class PlacementMode(StrEnum):
    disaggregated = "disaggregated"
    colocated = "colocated"


class EngineKind(StrEnum):
    reference = "reference"
    vllm = "vllm"


def _strategies(value: str) -> str:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        bad = ", ".join(map(repr, unknown)) or repr(value)
        raise typer.BadParameter(f"unknown strategy {bad} (known: {', '.join(STRATEGIES)})")
    return value


ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Preset name (see `kvmove models list`), path to an HF config.json, or a checkpoint directory.",
        rich_help_panel=PANEL_MODEL,
    ),
]
EngineDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--engine-dtype",
        metavar="bf16|fp8",
        help="The engine's weight format (fp8: e4m3 with 128x128 block scales, quantized inside the sync); "
        "default: the model's own (the -fp8 presets: fp8).",
        rich_help_panel=PANEL_MODEL,
    ),
]
ModelArg = Annotated[
    str,
    typer.Argument(help="Preset name, path to an HF-style config.json, or a checkpoint directory (+ safetensors)."),
]
OverrideOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--override",
        "-o",
        help="Change a config field, key=value (repeatable); unknown keys are refused.",
        rich_help_panel=PANEL_MODEL,
    ),
]
TrainerOpt = Annotated[
    str,
    typer.Option(
        "--trainer",
        help="Trainer layout: tp=..,pp=..,ep=..[,etp=..][,dp=..] (Megatron-style).",
        rich_help_panel=PANEL_MODEL,
    ),
]
EngineOpt = Annotated[
    str,
    typer.Option("--engine", help="One engine's layout: tp=..,dp=..,ep=..[,pp=..].", rich_help_panel=PANEL_MODEL),
]
ReplicasOpt = Annotated[
    int | None,
    typer.Option("--replicas", help="Number of engine replicas.", min=1, rich_help_panel=PANEL_MODEL),
]
StrategyOpt = Annotated[
    str,
    typer.Option(
        "--strategy",
        metavar="[" + "|".join(STRATEGIES) + "],...",
        help="Comma-separated strategies, run in this order.",
        callback=_strategies,
        rich_help_panel=PANEL_MODEL,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json", help="One JSON object per line on stdout (logs stay on stderr).", rich_help_panel=PANEL_OUTPUT
    ),
]
ResultsOpt = Annotated[
    Path | None,
    typer.Option(
        "--results",
        metavar="DIR",
        help="Append measured rows to DIR/<suite>.parquet (nothing is recorded without it).",
        rich_help_panel=PANEL_OUTPUT,
    ),
]
NoRecordOpt = Annotated[
    bool,
    typer.Option("--no-record", hidden=True, help="Kept for old scripts: rows are recorded only with --results."),
]

# -- where the ranks of a sync run (sync-weights, run mode) --------------------------------------------------
LauncherOpt = Annotated[
    Launcher,
    typer.Option(
        "--launcher", help="Ranks as Ray actors, or as plain local processes (no Ray).", rich_help_panel=PANEL_RUN
    ),
]
TrainerDevicesOpt = Annotated[
    str,
    typer.Option(
        "--trainer-devices",
        metavar="DEVICES",
        help="Trainer ranks' devices, cycled: cpu, or cuda:0,cuda:1,...",
        rich_help_panel=PANEL_RUN,
    ),
]
EngineDevicesOpt = Annotated[
    str,
    typer.Option(
        "--engine-devices",
        metavar="DEVICES",
        help="Engine ranks' devices, cycled: cpu, or cuda:1,...",
        rich_help_panel=PANEL_RUN,
    ),
]
PlacementOpt = Annotated[
    PlacementMode,
    typer.Option(
        "--placement",
        help="Trainer and engine ranks on separate devices, or sharing them (colocated: a region that stays on "
        "its device is a device-to-device copy).",
        rich_help_panel=PANEL_RUN,
    ),
]
FailTrainerOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fail-trainer",
        metavar="T@S[:mid]",
        help="Kill trainer rank T before sync S or during it (the run then ends, exit 1); repeatable.",
        rich_help_panel=PANEL_FAULTS,
    ),
]


def parse_slow_engine(text: str) -> tuple[int, float]:
    """``--slow-engine REPLICA=SECONDS`` -> (replica, seconds)."""
    replica, sep, seconds = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(replica), float(seconds)
    except ValueError:
        raise KvmoveError(f"--slow-engine {text!r} is not REPLICA=SECONDS") from None
