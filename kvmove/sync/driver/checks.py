"""Up-front refusals: everything a run can be refused for is checked here, before any rank (or Ray) starts.

The one owner of sync-config validation. ``checked`` (real syncs) runs once per config: the CLI checks before its
first progress line, and ``run_syncs`` takes the checked config without checking it again. A dry run moves no
bytes and starts nothing, so ``check_plannable`` is its share of the same checks (layouts, the engine's dtype,
the checkpoint format; with ``--verify`` a checkpoint small enough to materialize).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

from kvmove.engines import get_engine
from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.memory import usable_memory
from kvmove.models.totals import model_totals
from kvmove.sync.config import Side, SyncConfig
from kvmove.sync.launchers import get_launcher
from kvmove.sync.strategies import Delivery, Gather
from kvmove.transport import get_transport

MEMORY_FRACTION = 0.6


_CHECKED: dict[int, weakref.ref[SyncConfig]] = {}
"""Configs ``checked`` returned (by id, while they live): checking one again returns it as it is."""


def checked(config: SyncConfig) -> SyncConfig:
    """``config`` with its transport resolved to a concrete name, or a KvmoveError saying what is wrong. A config
    this function returned is returned as it is (the checks run once per run)."""
    seen = _CHECKED.get(id(config))
    if seen is not None and seen() is config:
        return config
    check_layouts(config)
    check_placement(config)
    check_faults(config)
    check_engine_kind(config)
    check_engine_build(config)
    check_format(config)
    config = replace(config, transport=check_transport(config))
    check_memory(config)
    config = delta_checked(config)
    key = id(config)
    _CHECKED[key] = weakref.ref(config, lambda _ref: _CHECKED.pop(key, None))
    return config


def delta_checked(config: SyncConfig) -> SyncConfig:
    """Delta syncs diff what the trainer packs: every region is planned packed (no direct reads, which land
    without the trainer seeing their bytes); ``full_every`` means nothing without them."""
    if config.full_every and not config.delta:
        raise KvmoveError("--full-every applies to delta syncs: add --delta")
    if config.delta and config.options.direct:
        return replace(config, options=replace(config.options, direct=False))
    return config


def check_plannable(config: SyncConfig) -> None:
    """What a dry run (plans only: no rank, transport or fault) is refused for: the checks it shares with real
    syncs, and with --verify a checkpoint that can be materialized here."""
    from kvmove.models.weights import check_verifiable

    check_layouts(config)
    get_engine(config.engine_kind).check_dtype(config.model)
    check_format(config)
    if config.verify:
        check_verifiable(config.model)


def check_layouts(config: SyncConfig) -> None:
    """Trainer and engine layouts that tile the model (kvmove.models.layout names the violated constraint)."""
    config.trainer.validate(config.model)
    config.engine.validate(config.model)


def check_placement(config: SyncConfig) -> None:
    p = config.placement
    launcher = get_launcher(p.launcher)
    if p.colocated and p.engine_devices != ("cpu",) and p.engine_devices != p.trainer_devices:
        raise KvmoveError(
            "--placement colocated runs engine rank i on trainer rank i's device: give --trainer-devices only"
        )
    gpus = p.colocated and any(d.startswith("cuda") for d in p.trainer_devices)
    if gpus and any(s.delivery is Delivery.BROADCAST for s in config.strategies):
        raise KvmoveError(
            "the broadcast baseline is one NCCL group over every rank, and NCCL refuses two ranks of one "
            "group on one GPU: run it disaggregated (v1, v2 and v3 run colocated)"
        )
    if p.ray_address and not launcher.actors:
        raise KvmoveError(f"--ray-address joins a Ray cluster, which the {p.launcher} launcher does not use")
    devices = {d for d in (*p.trainer_devices, *p.used_engine_devices()) if d.startswith("cuda")}
    if devices:
        import torch

        have = torch.cuda.device_count()
        bad = sorted(d for d in devices if (int(d.split(":")[1]) if ":" in d else 0) >= have)
        if bad:
            raise KvmoveError(f"device {bad[0]} does not exist here ({have} CUDA device(s) visible)")


def check_faults(config: SyncConfig) -> None:
    """Faults name replicas/ranks and syncs that exist, and can be survived by the chosen strategies."""
    sizes = {Side.ENGINE: config.engine.replicas, Side.TRAINER: config.trainer.world}
    for f in config.faults:
        flag = f"--fail-{f.side} {f.target}@{f.sync}{':mid' if f.during else ''}"
        if f.target >= sizes[f.side]:
            raise KvmoveError(f"{flag}: there is no {f.label()} (0..{sizes[f.side] - 1} exist)")
        if f.sync > config.syncs:
            raise KvmoveError(f"{flag}: the run has {config.syncs} sync(s) per strategy")
        if f.side is Side.ENGINE and f.during and any(s.delivery is Delivery.BROADCAST for s in config.strategies):
            raise KvmoveError(
                f"{flag}: the broadcast baseline is one collective over every live rank, so a replica killed during "
                "it stalls them all; inject mid-sync faults with v1, v2 or v3"
            )


def check_engine_kind(config: SyncConfig) -> None:
    """An unknown engine kind, an engine dtype it does not serve, a missing engine package, a layout or strategy
    the engine cannot take."""
    adapter = get_engine(config.engine_kind)
    adapter.check_dtype(config.model)
    adapter.check(config.engine)
    if not adapter.broadcast and any(s.delivery is Delivery.BROADCAST for s in config.strategies):
        raise KvmoveError(f"the broadcast baseline is not built for --engine-kind {adapter.name} (use v1, v2 or v3)")


def check_engine_build(config: SyncConfig) -> None:
    """What the engine's own construction refuses (an FP8 split that cuts a 128x128 quantization block, ...), found
    before anything starts: the first rank of each pipeline stage is built on meta tensors, one layer each (every
    rank of a stage holds equal shares, and the rules are per layer)."""
    adapter = get_engine(config.engine_kind)
    if not adapter.builds_outside:
        return
    layout = config.engine
    for stage, layers in enumerate(layout.stage_layers(config.model)):
        coord = next(layout.coord(r) for r in range(layout.ranks_per_replica) if layout.coord(r).pp == stage)
        adapter.build(config.model, layout, coord, layers=list(layers)[:1], device="meta")


def check_format(config: SyncConfig) -> None:
    """An unknown checkpoint format, or a model that format cannot hold (e.g. MLA in megatron-core's layout, an FP8
    engine fed megatron-core's tensors)."""
    from kvmove.errors import ModelError
    from kvmove.sync.planning.formats import get_format

    try:
        fmt = get_format(config.tensor_format)
        fmt.tensors(config.model, config.trainer, ())
        fmt.source_tensors(config.model, config.trainer)
    except ModelError as exc:
        raise KvmoveError(str(exc)) from None


def check_transport(config: SyncConfig) -> str:
    """The transport ``config.transport`` resolves to under its launcher, refused up front if it cannot run."""
    launcher = get_launcher(config.placement.launcher)
    cls = get_transport(config.transport, actors=launcher.actors)
    if cls.needs_actor and not launcher.actors:
        raise KvmoveError(f"transport {cls.name!r} lives in Ray actors: use --launcher ray")
    p = config.placement
    kinds = sorted({d.split(":")[0] for d in (*p.trainer_devices, *p.used_engine_devices())} - cls.devices)
    if kinds:
        moves = ", ".join(sorted(cls.devices))
        raise KvmoveError(f"transport {cls.name!r} does not move {kinds[0]} buffers (it moves {moves} buffers)")
    if p.colocated and not cls.shares_devices and any(d.startswith("cuda") for d in p.trainer_devices):
        raise KvmoveError(
            f"transport {cls.name!r} cannot serve colocated GPU ranks (NCCL refuses two ranks of one communicator "
            "on one GPU): use cuda-ipc or nixl"
        )
    if not cls.is_available():
        hint = f"pip install 'kvmove[{cls.extra}]'" if cls.extra else "see the README's transport notes"
        raise MissingDependencyError(f"transport {cls.name!r} is not installed here: {hint}")
    if any(f.side is Side.ENGINE for f in config.faults) and not cls.rejoinable:
        raise KvmoveError(
            f"fault injection needs a transport a restarted replica can rejoin (nixl, rdt-nixl, object-store, "
            f"cuda-ipc); {cls.name} binds every rank into one fixed group"
        )
    return cls.name


def check_memory(config: SyncConfig) -> None:
    """Refuse, before allocating anything, CPU runs whose ranks would not fit this machine's memory."""
    p = config.placement
    if any(d.startswith("cuda") for d in (*p.trainer_devices, *p.used_engine_devices())):
        return  # device memory: the ranks' own allocations say it clearly enough
    total = model_totals(config.model).total_bytes
    trainer = total  # shards over all trainer ranks plus, at most, one gathered copy per stage group
    engine = total * config.engine.replicas * 2  # parameters + their verification reference
    if any(s.delivery is Delivery.BROADCAST for s in config.strategies):
        engine += total * config.engine.world  # every engine rank receives the whole model
    if any(s.scope is Gather.GLOBAL for s in config.strategies):
        trainer += total * config.trainer.world  # every trainer rank materializes every tensor
    need, have = trainer + engine, usable_memory()
    if need > have * MEMORY_FRACTION:
        raise KvmoveError(
            f"{config.model.name} ({total / 1e9:.2f} GB) over {config.trainer.world} trainer and "
            f"{config.engine.world} engine ranks needs about {need / 1e9:.1f} GB here; only "
            f"{have * MEMORY_FRACTION / 1e9:.1f} GB may be used ({have / 1e9:.1f} GB available). "
            "Use a smaller model or fewer ranks."
        )
