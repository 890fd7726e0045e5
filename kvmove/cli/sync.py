"""`kvmove sync-weights`: plan, run and verify weight syncs from trainer ranks to engine ranks.

Parse -> config -> library call -> render. Three modes: real syncs (the default), ``--dry-run`` (plans only) and
``--simulate`` (predicted full-scale times); an option of one mode given in another is refused (``APPLIES``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvmove.cli import render, streams
from kvmove.cli.modes import check_options
from kvmove.cli.options import (
    DEFAULT_ENGINE,
    DEFAULT_MODEL,
    DEFAULT_REPLICAS,
    DEFAULT_TRAINER,
    PANEL_DRY,
    PANEL_FAULTS,
    PANEL_RUN,
    PANEL_SIM,
    PANEL_TUNING,
    SYNC_TRANSPORT_CHOICES,
    EngineDevicesOpt,
    EngineDtypeOpt,
    EngineKind,
    EngineOpt,
    FailTrainerOpt,
    JsonOpt,
    Launcher,
    LauncherOpt,
    ModelOpt,
    NoRecordOpt,
    OverrideOpt,
    PlacementMode,
    PlacementOpt,
    ReplicasOpt,
    ResultsOpt,
    StrategyOpt,
    TrainerDevicesOpt,
    TrainerOpt,
    parse_slow_engine,
    transport_choice,
)
from kvmove.errors import JobFailed, KvmoveError
from kvmove.transport import AUTO

if TYPE_CHECKING:
    from kvmove.sync.config import SyncConfig
    from kvmove.sync.driver.result import SyncResult

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


def sync_weights(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL,
    override: OverrideOpt = None,
    engine_dtype: EngineDtypeOpt = None,
    trainer: TrainerOpt = DEFAULT_TRAINER,
    engine: EngineOpt = DEFAULT_ENGINE,
    replicas: ReplicasOpt = None,
    strategy: StrategyOpt = "v1,v2,v3,broadcast",
    verify: VerifyOpt = False,
    seed: SeedOpt = 0,
    engine_kind: EngineKindOpt = EngineKind.reference,
    syncs: SyncsOpt = 1,
    ray_address: RayAddressOpt = None,
    launcher: LauncherOpt = Launcher.ray,
    trainer_devices: TrainerDevicesOpt = "cpu",
    engine_devices: EngineDevicesOpt = "cpu",
    placement: PlacementOpt = PlacementMode.disaggregated,
    dry_run: DryRunOpt = False,
    no_reuse: NoReuseOpt = False,
    simulate: SimulateOpt = False,
    cluster: ClusterOpt = "gpu=h100,nic=cx7-400",
    trainer_nodes: TrainerNodesOpt = 1,
    engine_nodes: EngineNodesOpt = 1,
    published_constraints: PublishedConstraintsOpt = False,
    fail_engine: FailEngineOpt = None,
    fail_trainer: FailTrainerOpt = None,
    slow_engine: SlowEngineOpt = None,
    deadline: DeadlineOpt = 60.0,
    transport: TransportOpt = AUTO,
    group_size: GroupSizeOpt = 1,
    lookahead: LookaheadOpt = 1,
    direct: DirectOpt = True,
    as_json: JsonOpt = False,
    results: ResultsOpt = None,
    no_record: NoRecordOpt = False,
    delta: DeltaOpt = False,
    full_every: FullEveryOpt = 0,
    train_step: TrainStepOpt = TrainStep.seeded,
    lr: LrOpt = 1e-6,
) -> None:
    """Sync weights trainer -> engine ranks (Ray actors or processes), or plan (--dry-run), or predict (--simulate).

    Exit codes: 0 every sync done (and bit-exact with --verify); 1 a sync did not verify or had no live engine;
    2 bad usage or input; 130 interrupted.

    Example: kvmove sync-weights --strategy v1,v2,v3,broadcast --syncs 3 --verify --json

    Example: kvmove sync-weights --launcher processes --trainer tp=1 --engine tp=1 --trainer-devices cuda:0
    --engine-devices cuda:1 --transport cuda-ipc --verify

    Example: kvmove sync-weights --dry-run --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32 --replicas 4

    Example: kvmove sync-weights --simulate --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32
    --replicas 4 --trainer-nodes 32 --engine-nodes 16 --published-constraints
    """
    if dry_run and simulate:
        raise KvmoveError("--dry-run and --simulate are two modes: give one")
    check_options(ctx, SIMULATE if simulate else DRY_RUN if dry_run else RUN, APPLIES)
    layout = {"trainer": trainer, "engine": engine, "replicas": replicas, "engine_dtype": engine_dtype}
    config = _config(model, override or [], layout, strategy, verify, seed, no_reuse, engine_kind.value)
    if simulate:
        spec: dict[str, Any] = {"model": model, "overrides": tuple(override or []), "trainer": trainer}
        spec |= {"engine": engine, "trainer_nodes": trainer_nodes, "engine_nodes": engine_nodes, "cluster": cluster}
        spec |= {"group_size": group_size, "lookahead": lookahead, "direct": direct}
        _simulate(config, spec, transport, published_constraints, results)
    elif dry_run:
        _dry_run(config, as_json)
    else:
        options = {"group_size": group_size, "lookahead": lookahead, "direct": direct}
        faults = {
            "fail_engine": fail_engine or [],
            "fail_trainer": fail_trainer or [],
            "slow_engine": slow_engine or [],
        }
        where: dict[str, Any] = {"launcher": launcher.value, "trainer": trainer_devices, "engine": engine_devices}
        where |= {"colocated": placement is PlacementMode.colocated, "ray_address": ray_address}
        run_config = _sync_config(config, transport, syncs, deadline, options, faults, where)
        run_config = _delta_config(run_config, delta, full_every, train_step, lr)
        _run(run_config, as_json, None if no_record else results)


def _config(
    model: str,
    override: list[str],
    layout: dict[str, Any],
    strategy: str,
    verify: bool,
    seed: int,
    no_reuse: bool,
    engine_kind: str,
) -> SyncConfig:
    """What every mode shares: the model, both layouts, the strategies (a dry run needs nothing else)."""
    from kvmove.models import parse_overrides, resolve_model
    from kvmove.models.checkpoint import with_engine_dtype
    from kvmove.models.layout import EngineLayout, TrainerLayout
    from kvmove.sync.config import SyncConfig, SyncOptions
    from kvmove.sync.strategies import parse_strategies

    engine, replicas = layout["engine"], layout["replicas"]
    default_replicas = DEFAULT_REPLICAS if engine == DEFAULT_ENGINE else 1
    cfg = resolve_model(model, parse_overrides(override))
    return SyncConfig(
        model=with_engine_dtype(cfg, layout["engine_dtype"]) if layout["engine_dtype"] else cfg,
        trainer=TrainerLayout.parse(layout["trainer"]),
        engine=EngineLayout.parse(engine, replicas if replicas is not None else default_replicas),
        strategies=tuple(parse_strategies(strategy)),
        verify=verify,
        seed=seed,
        options=SyncOptions(reuse=not no_reuse),
        engine_kind=engine_kind,
    )


def _sync_config(
    config: SyncConfig,
    transport: str,
    syncs: int,
    deadline: float,
    options: dict[str, Any],
    faults: dict[str, Any],
    where: dict[str, Any],
) -> SyncConfig:
    """The run's config: transport, planning options, placement and faults on top of what every mode shares."""
    from dataclasses import replace

    from kvmove.sync.config import Fault, Placement, Side, parse_devices

    placement = Placement(
        launcher=where["launcher"],
        trainer_devices=parse_devices(where["trainer"], "--trainer-devices"),
        engine_devices=parse_devices(where["engine"], "--engine-devices"),
        colocated=where["colocated"],
        ray_address=where["ray_address"] or _ray_address_env(where["launcher"]),
    )
    return replace(
        config,
        transport=transport,
        syncs=syncs,
        options=replace(config.options, **options),
        placement=placement,
        faults=tuple(Fault.parse(f, Side.ENGINE) for f in faults["fail_engine"])
        + tuple(Fault.parse(f, Side.TRAINER) for f in faults["fail_trainer"]),
        slow_replicas=tuple(parse_slow_engine(s) for s in faults["slow_engine"]),
        deadline_s=deadline,
    )


def _delta_config(config: SyncConfig, delta: bool, full_every: int, step: TrainStep, lr: float) -> SyncConfig:
    """``--delta`` (checked with the rest: ``kvmove.sync.driver.checks.delta_checked``) and ``--train-step``."""
    from dataclasses import replace

    from kvmove.sync.delta.stepping import AdamwStep, SteppedSource

    if step is TrainStep.adamw:
        config = replace(config, source=SteppedSource(AdamwStep(lr=lr)))
    return replace(config, delta=delta, full_every=full_every)


def _ray_address_env(launcher: str) -> str | None:
    """``RAY_ADDRESS``, as Ray's own tools read it (only where ranks are Ray actors)."""
    return (os.environ.get("RAY_ADDRESS") or None) if launcher == "ray" else None


def _run(config: SyncConfig, as_json: bool, results: Path | None) -> None:
    from kvmove.sync.driver.checks import checked
    from kvmove.sync.driver.run import run_syncs

    config = checked(config)  # refusals come before any progress output
    landed: list[SyncResult] = []

    def recorded(config: SyncConfig, progress: Any = None) -> Iterator[SyncResult]:
        for r in run_syncs(config, progress=progress):
            landed.append(r)
            yield r

    try:
        rows = render.run_syncs(recorded, config, as_json=as_json)
    except BaseException:
        if not as_json:  # NOTE: a run that failed part way still shows the syncs that completed (--json printed each)
            render.sync_table(landed)
        raise
    if results is not None and rows:
        from kvmove.bench.results import append_rows
        from kvmove.bench.syncs import sync_row

        path = append_rows(results, "sync", [sync_row(config, r) for r in rows])
        streams.note(f"{len(rows)} measured rows appended to {path}")
    failed = sync_failures(rows)
    if failed:
        raise JobFailed(failed)


def sync_failures(rows: list[SyncResult]) -> str:
    """One line naming every sync that had no live engine or did not verify (with the differing ranks); "" if none."""
    bad = []
    for r in rows:
        if r.live_engines == 0:
            dead = ", ".join(map(str, r.dead_replicas)) or "all"
            bad.append(f"{r.strategy} sync {r.sync}: no live engine (dead replicas: {dead})")
        elif r.verified is False:
            ranks = ", ".join(map(str, r.mismatched_ranks)) or "unknown"
            bad.append(f"{r.strategy} sync {r.sync}: engine ranks {ranks} differ from the loader's weights")
    if len(bad) > 4:
        bad = [*bad[:4], f"and {len(bad) - 4} more"]
    return "; ".join(bad)


def _dry_run(config: SyncConfig, as_json: bool) -> None:
    from kvmove.sync.driver.dryrun import dry_run_sync

    reports = dry_run_sync(config)
    if as_json:
        render.json_lines(r.as_json() for r in reports)
    else:
        render.dry_run(reports)
    bad = [
        f"{r.strategy}: {len(r.mismatches)} regions differ ({r.mismatches[0]})" for r in reports if r.verified is False
    ]
    if bad:
        raise JobFailed("dry-run verification failed: " + "; ".join(bad))


def _simulate(config: SyncConfig, spec: dict[str, Any], transport: str, published: bool, results: Path | None) -> None:
    """Predicted full-scale times as JSON lines; costs come from the measured rows under ``results``."""
    from kvmove.bench.sim.setup import Spec
    from kvmove.cli.simulate import simulate_json

    spec = {**spec, "replicas": config.engine.replicas, "direct": spec["direct"] and not published}
    spec |= {"transport": {"nccl": "nccl", "cuda-ipc": "cuda-ipc"}.get(transport, "pull")}
    spec |= {"constraints": "published" if published else "kvmove", "dtype": config.model.engine_dtype}
    spec |= {"quantize_on": "trainer"} if config.model.engine_dtype == "fp8" else {}  # where kvmove's plan does
    strategies = ",".join(s.name for s in config.strategies)
    render.json_lines(simulate_json(Spec(**spec), strategies, results or Path("results")))
