"""The options of `kvmove sync-weights` (its own; those other commands share are kvmove.cli.options) and the
modes each applies to (``APPLIES``: one given in another mode is refused)."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from kvmove.cli.options import (
    PANEL_DRY,
    PANEL_FAULTS,
    PANEL_RUN,
    PANEL_SIM,
    PANEL_TUNING,
    SYNC_TRANSPORT_CHOICES,
    EngineKind,
    transport_choice,
)

RUN, DRY_RUN, SIMULATE = "real syncs", "--dry-run", "--simulate"
APPLIES: dict[str, tuple[str, ...]] = {
    "verify": (RUN, DRY_RUN),
    "seed": (RUN, DRY_RUN),
    "engine_kind": (RUN, DRY_RUN),
    "no_reuse": (DRY_RUN,),
    "transport": (RUN, SIMULATE),
    "syncs": (RUN,),
    "ray_address": (RUN,),
    "launcher": (RUN,),
    "trainer_devices": (RUN,),
    "engine_devices": (RUN,),
    "placement": (RUN,),
    "fail_trainer": (RUN,),
    "deadline": (RUN,),
    "group_size": (RUN, SIMULATE),
    "lookahead": (RUN, SIMULATE),
    "direct": (RUN, SIMULATE),
    "fail_engine": (RUN,),
    "slow_engine": (RUN,),
    "results": (RUN, SIMULATE),
    "no_record": (RUN, SIMULATE),
    "cluster": (SIMULATE,),
    "trainer_nodes": (SIMULATE,),
    "engine_nodes": (SIMULATE,),
    "published_constraints": (SIMULATE,),
    "delta": (RUN,),
    "full_every": (RUN,),
    "train_step": (RUN,),
    "lr": (RUN,),
}


VerifyOpt = Annotated[
    bool,
    typer.Option(
        "--verify", help="Check every engine rank bit-exact (real syncs, --dry-run).", rich_help_panel=PANEL_RUN
    ),
]
SeedOpt = Annotated[
    int,
    typer.Option("--seed", help="Seed of the random weights (real syncs, --dry-run).", rich_help_panel=PANEL_RUN),
]
EngineKindOpt = Annotated[
    EngineKind,
    typer.Option(
        "--engine-kind", help="kvmove's reference engine, or a live vLLM per replica.", rich_help_panel=PANEL_RUN
    ),
]
SyncsOpt = Annotated[int, typer.Option("--syncs", min=1, help="Syncs per strategy.", rich_help_panel=PANEL_RUN)]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="Join an existing Ray cluster (default: RAY_ADDRESS if set, else a local Ray).",
        rich_help_panel=PANEL_RUN,
    ),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Build and summarize plans; move no bytes.", rich_help_panel=PANEL_DRY)
]
NoReuseOpt = Annotated[
    bool,
    typer.Option(
        "--no-reuse", help="Record the loader over every layer (no template reuse).", rich_help_panel=PANEL_DRY
    ),
]
SimulateOpt = Annotated[
    bool, typer.Option("--simulate", help="Predict full-scale times (no bytes move).", rich_help_panel=PANEL_SIM)
]
ClusterOpt = Annotated[
    str,
    typer.Option(
        "--cluster",
        help="gpu=h100,nic=cx7-400[,gpus_per_node=8,nic_gbps=400 (Gb/s),nvlink_gbps=450]",
        rich_help_panel=PANEL_SIM,
    ),
]
TrainerNodesOpt = Annotated[
    int, typer.Option("--trainer-nodes", min=1, help="Nodes of trainer ranks.", rich_help_panel=PANEL_SIM)
]
EngineNodesOpt = Annotated[
    int, typer.Option("--engine-nodes", min=1, help="Nodes of engine ranks.", rich_help_panel=PANEL_SIM)
]
PublishedConstraintsOpt = Annotated[
    bool,
    typer.Option(
        "--published-constraints",
        help="Serial PP groups, layer-wise reload, synchronized replicas.",
        rich_help_panel=PANEL_SIM,
    ),
]
FailEngineOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fail-engine",
        metavar="R@S[:mid]",
        help="Kill replica R before sync S (R@S) or during it (R@S:mid); repeatable.",
        rich_help_panel=PANEL_FAULTS,
    ),
]
SlowEngineOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--slow-engine",
        metavar="R=SECONDS",
        help="Delay replica R by SECONDS per group; repeatable.",
        rich_help_panel=PANEL_FAULTS,
    ),
]
DeadlineOpt = Annotated[
    float,
    typer.Option("--deadline", help="Seconds without progress before a peer is dropped.", rich_help_panel=PANEL_FAULTS),
]
TransportOpt = Annotated[
    str,
    typer.Option(
        "--transport",
        metavar="NAME",
        help=f"Byte mover of the pulls: {', '.join(SYNC_TRANSPORT_CHOICES)} (auto: the first available of nixl, "
        "rdt-nixl, rdt-gloo, gloo).",
        callback=transport_choice(SYNC_TRANSPORT_CHOICES),
        rich_help_panel=PANEL_TUNING,
    ),
]
GroupSizeOpt = Annotated[
    int, typer.Option("--group-size", min=1, help="v3: decoder blocks per group.", rich_help_panel=PANEL_TUNING)
]
LookaheadOpt = Annotated[
    int, typer.Option("--lookahead", min=0, help="v3: groups gathered ahead.", rich_help_panel=PANEL_TUNING)
]
DirectOpt = Annotated[
    bool,
    typer.Option(
        "--direct/--no-direct",
        help="v2/v3: read regions lying in a trainer shard straight from its arena into the parameters.",
        rich_help_panel=PANEL_TUNING,
    ),
]


DeltaOpt = Annotated[
    bool,
    typer.Option(
        "--delta",
        help="Packed pulls move only the words changed since the engine's last sync (dense where not smaller); "
        "direct pulls are planned packed.",
        rich_help_panel=PANEL_RUN,
    ),
]
FullEveryOpt = Annotated[
    int,
    typer.Option("--full-every", min=0, help="--delta: every N-th sync is full (0: never).", rich_help_panel=PANEL_RUN),
]


class TrainStep(enum.StrEnum):
    seeded = "seeded"
    adamw = "adamw"


TrainStepOpt = Annotated[
    TrainStep,
    typer.Option(
        "--train-step",
        help="The trainer's weights per sync: fresh seeded ones, or FP32 masters stepped by AdamW (BF16 image).",
        rich_help_panel=PANEL_RUN,
    ),
]
LrOpt = Annotated[
    float,
    typer.Option("--lr", min=1e-12, help="--train-step adamw: learning rate.", rich_help_panel=PANEL_RUN),
]
