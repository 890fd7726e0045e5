"""Option aliases shared by commands (one spelling, one help text), the choices they accept (enums, shown in
``--help``) and the help panels that group them.

Nothing here imports torch, pandas or Ray: ``kvmove --help`` must stay fast. Transport names come from their owner
(kvmove.transport, whose names import without torch); the enums of engines and KV data planes mirror registries
that do import torch, and tests/cli keep the two equal.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from kvmove.errors import KvmoveError
from kvmove.sync.strategies import STRATEGIES
from kvmove.transport import AUTO, SYNC_TRANSPORTS

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


SYNC_TRANSPORT_CHOICES = (AUTO, *SYNC_TRANSPORTS)
"""--transport of a weight sync: kvmove.transport owns the names and what ``auto`` means."""
BENCH_TRANSPORT_CHOICES = (*SYNC_TRANSPORT_CHOICES, "http")
"""--transport of the benchmarks: the sync transports, and http (the KV servers' data plane, for decode-latency)."""


def transport_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A --transport callback accepting ``choices`` (kvmove.transport's names), else one line naming them."""

    def check(value: str) -> str:
        if value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(map(repr, choices))}")
        return value

    return check


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


def _results_dir(value: Path | None) -> Path | None:
    """--results DIR: refused up front (before anything runs) when the tree is dirty, as its rows would be."""
    if value is not None:
        from kvmove.bench.results import git_commit, require_traceable

        try:
            require_traceable(git_commit())
        except KvmoveError as exc:
            raise typer.BadParameter(str(exc)) from None
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
BenchTransportOpt = Annotated[
    str,
    typer.Option(
        "--transport",
        metavar="NAME",
        help="Transport of the sync, vllm (pulls) and decode-latency (KV) suites: "
        + ", ".join(BENCH_TRANSPORT_CHOICES)
        + ".",
        callback=transport_choice(BENCH_TRANSPORT_CHOICES),
    ),
]
ResultsOpt = Annotated[
    Path | None,
    typer.Option(
        "--results",
        metavar="DIR",
        help="Append measured rows to DIR/<suite>.parquet (nothing is recorded without it; only from a clean tree).",
        callback=_results_dir,
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


class SlowEngine(NamedTuple):
    """``--slow-engine REPLICA=SECONDS``: replica ``replica`` waits ``seconds`` per group."""

    replica: int
    seconds: float


def parse_slow_engine(text: str) -> SlowEngine:
    """``--slow-engine REPLICA=SECONDS`` -> SlowEngine(replica, seconds)."""
    replica, sep, seconds = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return SlowEngine(int(replica), float(seconds))
    except ValueError:
        raise KvmoveError(f"--slow-engine {text!r} is not REPLICA=SECONDS") from None
