"""`kvmove sync-weights`: plan, run and verify weight syncs from trainer ranks to engine ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvmove.bench.results import append_rows
from kvmove.bench.syncs import sync_row
from kvmove.cli import render
from kvmove.cli.options import (
    DEFAULT_ENGINE,
    DEFAULT_MODEL,
    DEFAULT_REPLICAS,
    DEFAULT_TRAINER,
    EngineOpt,
    JsonOpt,
    ModelOpt,
    OverrideOpt,
    ReplicasOpt,
    SeedOpt,
    StrategyOpt,
    TrainerOpt,
)
from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models import parse_overrides, resolve_model
from kvmove.sync.dryrun import DryRunConfig, dry_run_sync
from kvmove.sync.runner import Fault, SyncConfig, run_syncs
from kvmove.sync.schedule import SyncOptions
from kvmove.sync.strategies import parse_strategies


def sync_weights(
    model: ModelOpt = DEFAULT_MODEL,
    override: OverrideOpt = None,
    trainer: TrainerOpt = DEFAULT_TRAINER,
    engine: EngineOpt = DEFAULT_ENGINE,
    replicas: ReplicasOpt = None,
    strategy: StrategyOpt = "v1,v2,v3,broadcast",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Build and summarize plans; move no bytes.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Check engine weights bit-exact.")] = False,
    as_json: JsonOpt = False,
    seed: SeedOpt = 0,
    no_reuse: Annotated[
        bool, typer.Option("--no-reuse", help="Dry-run the loader over every layer (no template reuse).")
    ] = False,
    transport: Annotated[
        str, typer.Option("--transport", help="auto|nixl|rdt-nixl|rdt-gloo|gloo|object-store.")
    ] = "auto",
    syncs: Annotated[int, typer.Option("--syncs", min=1, help="Syncs per strategy.")] = 1,
    ray_address: Annotated[
        str | None, typer.Option("--ray-address", help="Join an existing Ray cluster (default: local).")
    ] = None,
    results: Annotated[Path, typer.Option("--results", help="Append measured rows to DIR/sync.parquet.")] = Path(
        "results"
    ),
    no_record: Annotated[bool, typer.Option("--no-record", help="Do not append rows to --results.")] = False,
    fail_engine: Annotated[
        list[str] | None,
        typer.Option("--fail-engine", help="Kill replica R before sync S (R@S) or during it (R@S:mid); repeatable."),
    ] = None,
    slow_engine: Annotated[
        list[str] | None, typer.Option("--slow-engine", help="Delay replica R by SECONDS per group (R=SECONDS).")
    ] = None,
    group_size: Annotated[int, typer.Option("--group-size", min=1, help="v3: decoder blocks per group.")] = 1,
    lookahead: Annotated[int, typer.Option("--lookahead", min=0, help="v3: groups gathered ahead.")] = 1,
    engine_kind: Annotated[
        str, typer.Option("--engine-kind", help="reference (kvmove's engine) or vllm (a live vLLM per replica).")
    ] = "reference",
    direct: Annotated[
        bool,
        typer.Option(
            "--direct/--no-direct",
            help="v2/v3: read regions lying in a trainer shard straight from its arena into the parameters.",
        ),
    ] = True,
    deadline: Annotated[
        float, typer.Option("--deadline", help="Seconds without progress before a peer is dropped.")
    ] = 60.0,
    simulate: Annotated[bool, typer.Option("--simulate", help="Predict full-scale times (no bytes move).")] = False,
    cluster: Annotated[
        str,
        typer.Option("--cluster", help="gpu=h100,nic=cx7-400[,gpus_per_node=8,nic_gbps=400 (Gb/s),nvlink_gbps=450]"),
    ] = "gpu=h100,nic=cx7-400",
    trainer_nodes: Annotated[int, typer.Option("--trainer-nodes", min=1, help="Nodes of trainer ranks.")] = 1,
    engine_nodes: Annotated[int, typer.Option("--engine-nodes", min=1, help="Nodes of engine ranks.")] = 1,
    published_constraints: Annotated[
        bool,
        typer.Option("--published-constraints", help="Serial PP groups, layer-wise reload, synchronized replicas."),
    ] = False,
) -> None:
    """Sync weights from trainer ranks (Ray actors) to engine ranks, or plan it (--dry-run).

    Example: kvmove sync-weights --strategy v1,v2,v3,broadcast --syncs 3 --verify --json

    Example: kvmove sync-weights --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32 --replicas 4 --dry-run

    Example: kvmove sync-weights --simulate --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32
    --replicas 4 --trainer-nodes 32 --engine-nodes 16 --published-constraints
    """
    cfg = resolve_model(model, parse_overrides(override or []))
    engine_layout = EngineLayout.parse(engine, replicas if replicas is not None else _default_replicas(engine))
    config = DryRunConfig(
        model=cfg,
        trainer=TrainerLayout.parse(trainer),
        engine=engine_layout,
        strategies=tuple(parse_strategies(strategy)),
        verify=verify,
        seed=seed,
        reuse=not no_reuse,
        engine_kind=engine_kind,
    )
    if simulate:
        from kvmove.bench.sim.setup import Spec
        from kvmove.cli.simulate import simulate_json

        spec = Spec(
            model=model,
            overrides=tuple(override or []),
            trainer=trainer,
            engine=engine,
            replicas=engine_layout.replicas,
            trainer_nodes=trainer_nodes,
            engine_nodes=engine_nodes,
            cluster=cluster,
            transport={"nccl": "nccl", "cuda-ipc": "cuda-ipc"}.get(transport, "pull"),
            direct=direct and not published_constraints,
            constraints="published" if published_constraints else "kvmove",
            group_size=group_size,
            lookahead=lookahead,
        )
        render.json_lines(simulate_json(spec, ",".join(s.name for s in config.strategies), results))
        return
    if not dry_run:
        sync_config = SyncConfig(
            model=cfg,
            trainer=config.trainer,
            engine=engine_layout,
            strategies=config.strategies,
            transport=transport,
            syncs=syncs,
            verify=verify,
            seed=seed,
            options=SyncOptions(group_size=group_size, lookahead=lookahead, direct=direct),
            ray_address=ray_address,
            engine_kind=engine_kind,
            faults=tuple(Fault.parse(f) for f in fail_engine or []),
            slow_replicas=tuple(_slow(s) for s in slow_engine or []),
            deadline_s=deadline,
        )
        rows = render.run_syncs(run_syncs, sync_config, as_json=as_json)
        if not no_record and rows:
            append_rows(results, "sync", [sync_row(sync_config, r) for r in rows])
        if verify and not all(r.verified for r in rows):
            raise typer.Exit(1)
        return
    reports = dry_run_sync(config)
    if as_json:
        render.json_lines(r.as_json() for r in reports)
    else:
        render.dry_run(reports)
    if verify and not all(r.verified for r in reports):
        raise typer.Exit(1)


def _slow(text: str) -> tuple[int, float]:
    replica, sep, seconds = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(replica), float(seconds)
    except ValueError:
        raise KvmoveError(f"--slow-engine {text!r} is not REPLICA=SECONDS") from None


def _default_replicas(engine: str) -> int:
    return DEFAULT_REPLICAS if engine == DEFAULT_ENGINE else 1
