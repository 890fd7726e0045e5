"""The GPU suite's weight-sync matrix: layouts x placements x pull transports, every sync verified, and for each
(layout, placement, transport) a ceiling row computed from the same run.

A *cell* is one run of ranks (one cluster, plain processes): a layout, a placement and a transport, syncing every
strategy ``suite.syncs`` times. Placements: colocated (engine rank i on trainer rank i's device, ``suite.devices``
cycled: every rank on one GPU when the machine has one, the verl-style hybrid engine) for every layout, and
disaggregated (trainer on the first device, engine on the second) for the 1->1 layout where two devices exist.
The broadcast baseline and the nccl transport run disaggregated only (NCCL refuses two ranks of one group on one GPU).

A cell's ceiling: its v3 payload split by where it travels (``SyncResult.link_bytes``: bytes that stay on a device
and bytes that cross a link, the busiest device and link direction), the former at the device-copy rate and the
latter at the peer-to-peer rate measured in the same run (``kvmove.sync.planning.ceiling.ceiling_seconds``). Each
sync row of the cell carries it (``extra.ceiling_seconds``, ``extra.fraction_of_ceiling``) and its
``link_limit_gbps`` is the cell's bytes over that time, so the report's "v3 % ceiling" is v3's share of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvmove.bench.results import Row, link_conditions
from kvmove.errors import JobFailed, KvmoveError
from kvmove.sync.planning.ceiling import seconds_at

if TYPE_CHECKING:
    from kvmove.models.config import ModelConfig
    from kvmove.sync.config import Placement, SyncConfig
    from kvmove.sync.driver.result import SyncResult

Say = Callable[[str], None]
Record = Callable[[list[Row]], object]


class Layout(NamedTuple):
    """Trainer layout -> engine layout (``replicas`` engine replicas)."""

    trainer: str
    engine: str
    replicas: int = 1

    @property
    def label(self) -> str:
        return f"{self.trainer} -> {self.engine}" + (f" x{self.replicas}" if self.replicas > 1 else "")


LAYOUTS = (
    Layout("tp=1", "tp=1"),
    Layout("tp=2,ep=2", "tp=2,ep=2"),
    Layout("tp=2,ep=2", "dp=2,ep=2"),
    Layout("pp=2", "tp=2"),
    Layout("tp=2,ep=2", "tp=1", 2),
)
"""The issue's four resharding layouts and the 1->1 one (Qwen3-235B-A22B slices at full layer width)."""


class GpuSuite(Protocol):
    """What the matrix reads of ``kvmove.bench.gpu.GpuSuite`` (read-only)."""

    @property
    def model(self) -> str: ...

    @property
    def layers(self) -> int: ...

    @property
    def syncs(self) -> int: ...

    @property
    def transports(self) -> tuple[str, ...]: ...

    @property
    def strategies(self) -> str: ...

    @property
    def layouts(self) -> tuple[Layout, ...]: ...

    @property
    def devices(self) -> tuple[str, ...]: ...

    @property
    def deadline_s(self) -> float: ...

    @property
    def cuda(self) -> bool: ...


class Rates(NamedTuple):
    """Rates measured in the same run: bytes copied per second inside a device and over the peer link (GB/s)."""

    copy_gbps: float
    link_gbps: float


class Cell(NamedTuple):
    layout: Layout
    placement: Placement
    transport: str
    strategies: str


def cells(suite: GpuSuite, transports: list[str], say: Say) -> list[Cell]:
    """Every cell of the matrix this machine can run, in order (a layout's cells together)."""
    from kvmove.sync.config import Placement
    from kvmove.transport import TRANSPORTS

    out = []
    for layout in suite.layouts:
        places = [Placement("processes", suite.devices, colocated=True)]
        if layout == LAYOUTS[0] and len(suite.devices) > 1:
            places.insert(0, Placement("processes", suite.devices[:1], suite.devices[1:2]))
        for place in places:
            shared = place.colocated and suite.cuda
            runnable = [t for t in transports if not shared or TRANSPORTS[t].shares_devices]
            for t in sorted(set(transports) - set(runnable)):
                say(f"{layout.label} colocated: {t} cannot serve ranks sharing a device, not run")
            for t in runnable:
                baseline = not place.colocated and t == runnable[0]
                names = [s for s in suite.strategies.split(",") if s and (baseline or not s.startswith("broadcast"))]
                out.append(Cell(layout, place, t, ",".join(names)))
    return out


def weight_syncs(suite: GpuSuite, rates: Rates, record: Record, say: Say) -> list[Row]:
    """Run every cell of the matrix; each cell's rows (syncs, then its ceiling) are recorded as they land."""
    from kvmove.models import model_totals, resolve_model
    from kvmove.transport import TRANSPORTS

    cfg = resolve_model(suite.model, {"num_hidden_layers": suite.layers})
    say(f"weight sync: {cfg.name} with {suite.layers} layers, {model_totals(cfg).total_bytes / 1e9:.1f} GB per sync")
    transports = [t for t in suite.transports if t in TRANSPORTS and TRANSPORTS[t].is_available()]
    for skipped in sorted(set(suite.transports) - set(transports)):
        say(f"{skipped}: NOT INSTALLED here, its cells are not run")
    if not transports:
        raise KvmoveError(f"none of the transports {', '.join(suite.transports)} is installed here")
    rows: list[Row] = []
    failed = []
    for cell in cells(suite, transports, say):
        done = run_cell(suite, cfg, cell, rates, say)
        record(done.rows)
        rows += done.rows
        if done.error is not None:
            failed.append(f"{cell.layout.label} {cell.placement.mode} {cell.transport}: {done.error}")
    if failed:  # every other cell's rows are recorded by now
        raise KvmoveError(f"{len(failed)} weight-sync cell(s) failed: {'; '.join(failed)}")
    return rows


class CellRows(NamedTuple):
    rows: list[Row]
    error: str | None
    """Why the cell failed (a sync that did not run or did not verify), None if it did not."""


def run_cell(suite: GpuSuite, cfg: ModelConfig, cell: Cell, rates: Rates, say: Say) -> CellRows:
    """One cell's verified syncs as rows, then its ceiling row; a failed cell says why and loses no other cell."""
    from kvmove.sync.driver.run import run_syncs

    config = _config(suite, cfg, cell)
    say(f"{cell.layout.label} {cell.placement.mode} {cell.transport}: {cell.strategies}")
    results, error = [], None
    try:
        for r in run_syncs(config, progress=lambda _: None):
            say(f"  {r.strategy} sync {r.sync}: {r.seconds:.4f} s, {r.gbps:.1f} GB/s, verified={r.verified}")
            results.append(r)
    except (KvmoveError, JobFailed) as exc:
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        say(f"  {cell.layout.label} {cell.placement.mode} {cell.transport} FAILED: {exc}")
    finally:
        if suite.cuda:
            import torch

            torch.cuda.empty_cache()
    split = _split(results)
    ceiling = 0.0
    if split is not None and (rates.link_gbps or not split.cross_max):  # a link this run measured, or none crossed
        ceiling = seconds_at(split.local_max, split.cross_max, rates.copy_gbps, rates.link_gbps)
    link = link_conditions()
    rows = [_sync_row(config, r, suite, ceiling, link) for r in results]
    if split is not None and ceiling > 0:
        rows.append(_ceiling_row(config, cell, split, ceiling, rates))
        say(f"  ceiling: {ceiling:.4f} s ({split.total / ceiling / 1e9:.1f} GB/s)")
    if error is None and not all(r.verified for r in results):
        error = "a sync did not verify bit-exact"
    return CellRows(rows, error)


def _config(suite: GpuSuite, cfg: ModelConfig, cell: Cell) -> SyncConfig:
    from kvmove.models.layout import EngineLayout, TrainerLayout
    from kvmove.sync.config import SyncConfig as Config
    from kvmove.sync.strategies import parse_strategies

    return Config(
        model=cfg,
        trainer=TrainerLayout.parse(cell.layout.trainer),
        engine=EngineLayout.parse(cell.layout.engine, cell.layout.replicas),
        strategies=tuple(parse_strategies(cell.strategies)),
        transport=cell.transport,
        syncs=suite.syncs,
        verify=True,
        placement=cell.placement,
        deadline_s=suite.deadline_s,
    )


class Split(NamedTuple):
    """A cell's v3 payload by where it travels (from its last v3 row's ``link_bytes``)."""

    total: int
    local_max: int
    cross_max: int


def _split(results: list[SyncResult]) -> Split | None:
    v3 = [r for r in results if r.strategy == "v3" and r.link_bytes]
    if not v3:
        return None
    b = v3[-1].link_bytes
    return Split(b["local_bytes"] + b["cross_bytes"], b["local_max_bytes"], b["cross_max_bytes"])


def _sync_row(config: SyncConfig, r: SyncResult, suite: GpuSuite, ceiling: float, link: dict[str, str]) -> Row:
    from kvmove.bench.syncs import sync_row

    extra: dict[str, object] = {
        "model_overrides": {"num_hidden_layers": suite.layers},  # the simulator rebuilds the slice
        "ceiling_seconds": ceiling or None,
        "fraction_of_ceiling": ceiling / r.seconds if ceiling and r.seconds > 0 and r.bytes else None,
    }
    row = sync_row(config, r, suite="gpu", extra=extra, link=link)
    limit = r.bytes / ceiling / 1e9 if ceiling and r.bytes else row.link_limit_gbps
    return dataclasses.replace(row, link_limit_gbps=limit)


def _ceiling_row(config: SyncConfig, cell: Cell, split: Split, seconds: float, rates: Rates) -> Row:
    c = config
    return Row(
        kind="measured",
        suite="gpu",
        name=f"ceiling sync {cell.layout.label} {cell.placement.mode}",
        model=c.model.name,
        trainer=c.trainer.label(),
        engine=c.engine.label(),
        transport=cell.transport,
        bytes=split.total,
        seconds=seconds,
        gbps=split.total / seconds / 1e9,
        extra={
            "placement": cell.placement.mode,
            "local_max_bytes": split.local_max,
            "cross_max_bytes": split.cross_max,
            "copy_gbps": rates.copy_gbps,
            "p2p_gbps": rates.link_gbps,
            "trainer_devices": list(cell.placement.trainer_devices),
            "engine_devices": list(cell.placement.used_engine_devices()),
        },
    )
