"""`kvmove sync-weights`: plan, run and verify weight syncs from trainer ranks to engine ranks."""

from __future__ import annotations

from typing import Annotated

import typer

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
) -> None:
    """Sync weights from trainer ranks to engine ranks.

    Example: kvmove sync-weights --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32 --replicas 4 --dry-run
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
    )
    if not dry_run:
        raise KvmoveError("syncs that move bytes between Ray actors are not in this build yet; pass --dry-run")
    reports = dry_run_sync(config)
    if as_json:
        render.json_lines(r.as_json() for r in reports)
    else:
        render.dry_run(reports)
    if verify and not all(r.verified for r in reports):
        raise typer.Exit(1)


def _default_replicas(engine: str) -> int:
    return DEFAULT_REPLICAS if engine == DEFAULT_ENGINE else 1
