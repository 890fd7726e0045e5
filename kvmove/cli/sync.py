"""`kvmove sync-weights`: plan, run and verify weight syncs from trainer ranks to engine ranks.

Parse -> config -> library call -> render. Three modes: real syncs (the default), ``--dry-run`` (plans only) and
``--simulate`` (predicted full-scale times); an option of one mode given in another is refused (``APPLIES``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvmove.cli import render, streams
from kvmove.cli.modes import check_options
from kvmove.cli.options import (
    DEFAULT_ENGINE,
    DEFAULT_MODEL,
    DEFAULT_REPLICAS,
    DEFAULT_TRAINER,
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
)
from kvmove.cli.sync_options import (
    APPLIES,
    DRY_RUN,
    RUN,
    SIMULATE,
    ClusterOpt,
    DeadlineOpt,
    DeltaOpt,
    DirectOpt,
    DryRunOpt,
    EngineKindOpt,
    EngineNodesOpt,
    FailEngineOpt,
    FullEveryOpt,
    GroupSizeOpt,
    LookaheadOpt,
    LrOpt,
    NoReuseOpt,
    PublishedConstraintsOpt,
    RayAddressOpt,
    SeedOpt,
    SimulateOpt,
    SlowEngineOpt,
    SyncsOpt,
    TrainerNodesOpt,
    TrainStep,
    TrainStepOpt,
    TransportOpt,
    VerifyOpt,
)
from kvmove.errors import JobFailed, KvmoveError
from kvmove.transport import AUTO

if TYPE_CHECKING:
    from kvmove.sync.config import SyncConfig
    from kvmove.sync.driver.result import SyncResult


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
    config = _config(ctx.params)
    if simulate:
        _simulate(config, ctx.params, results)
    elif dry_run:
        _dry_run(config, as_json)
    else:
        _run(_run_config(config, ctx.params), as_json, None if no_record else results)


Params = Mapping[str, Any]
"""The command's options by parameter name, as parsed (``ctx.params``; enums as their values)."""


def _config(p: Params) -> SyncConfig:
    """What every mode shares: the model, both layouts, the strategies (a dry run needs nothing else)."""
    from kvmove.models import parse_overrides, resolve_model
    from kvmove.models.checkpoint import with_engine_dtype
    from kvmove.models.layout import EngineLayout, TrainerLayout
    from kvmove.sync.config import SyncConfig, SyncOptions
    from kvmove.sync.strategies import parse_strategies

    engine, replicas = p["engine"], p["replicas"]
    default_replicas = DEFAULT_REPLICAS if engine == DEFAULT_ENGINE else 1
    cfg = resolve_model(p["model"], parse_overrides(list(p["override"] or [])))
    return SyncConfig(
        model=with_engine_dtype(cfg, p["engine_dtype"]) if p["engine_dtype"] else cfg,
        trainer=TrainerLayout.parse(p["trainer"]),
        engine=EngineLayout.parse(engine, replicas if replicas is not None else default_replicas),
        strategies=tuple(parse_strategies(p["strategy"])),
        verify=p["verify"],
        seed=p["seed"],
        options=SyncOptions(reuse=not p["no_reuse"]),
        engine_kind=EngineKind(p["engine_kind"]).value,
    )


def _run_config(config: SyncConfig, p: Params) -> SyncConfig:
    """The run's config: transport, planning options, placement, faults and delta on top of what every mode shares
    (checked with the rest by ``kvmove.sync.driver.checks``)."""
    from dataclasses import replace

    from kvmove.sync.config import Fault, Placement, Side, parse_devices
    from kvmove.sync.delta.stepping import AdamwStep, SteppedSource

    launcher = Launcher(p["launcher"]).value
    placement = Placement(
        launcher=launcher,
        trainer_devices=parse_devices(p["trainer_devices"], "--trainer-devices"),
        engine_devices=parse_devices(p["engine_devices"], "--engine-devices"),
        colocated=PlacementMode(p["placement"]) is PlacementMode.colocated,
        ray_address=p["ray_address"] or _ray_address_env(launcher),
    )
    faults = [Fault.parse(f, Side.ENGINE) for f in p["fail_engine"] or ()]
    faults += [Fault.parse(f, Side.TRAINER) for f in p["fail_trainer"] or ()]
    options = replace(config.options, group_size=p["group_size"], lookahead=p["lookahead"], direct=p["direct"])
    config = replace(
        config,
        transport=p["transport"],
        syncs=p["syncs"],
        options=options,
        placement=placement,
        faults=tuple(faults),
        slow_replicas=tuple(parse_slow_engine(s) for s in p["slow_engine"] or ()),
        deadline_s=p["deadline"],
        delta=p["delta"],
        full_every=p["full_every"],
    )
    if TrainStep(p["train_step"]) is TrainStep.adamw:
        config = replace(config, source=SteppedSource(AdamwStep(lr=p["lr"])))
    return config


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
        from kvmove.bench.results import append_rows, link_conditions
        from kvmove.bench.syncs import sync_row

        link = link_conditions()
        path = append_rows(results, "sync", [sync_row(config, r, link=link) for r in rows])
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


def _simulate(config: SyncConfig, p: Params, results: Path | None) -> None:
    """Predicted full-scale times as JSON lines; costs come from the measured rows under ``results``."""
    from kvmove.bench.sim.setup import Spec
    from kvmove.cli.simulate import simulate_json

    published = p["published_constraints"]
    spec: dict[str, Any] = {"model": p["model"], "overrides": tuple(p["override"] or ()), "trainer": p["trainer"]}
    spec |= {"engine": p["engine"], "replicas": config.engine.replicas, "cluster": p["cluster"]}
    spec |= {"trainer_nodes": p["trainer_nodes"], "engine_nodes": p["engine_nodes"]}
    spec |= {"group_size": p["group_size"], "lookahead": p["lookahead"], "direct": p["direct"] and not published}
    spec |= {"transport": {"nccl": "nccl", "cuda-ipc": "cuda-ipc"}.get(p["transport"], "pull")}
    spec |= {"constraints": "published" if published else "kvmove", "dtype": config.model.engine_dtype}
    spec |= {"quantize_on": "trainer"} if config.model.engine_dtype == "fp8" else {}  # where kvmove's plan does
    strategies = ",".join(s.name for s in config.strategies)
    render.json_lines(simulate_json(Spec(**spec), strategies, results or Path("results")))
