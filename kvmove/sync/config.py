"""The one frozen configuration of a run of syncs, built once at the CLI edge (or by a framework's own code).

:class:`SyncConfig` holds the model, both layouts, the strategies, the transport and :class:`SyncOptions`
(planning knobs), where the ranks run (:class:`Placement`: launcher, devices, Ray address) and which faults to
inject (:class:`Fault`). Nothing below the CLI reads argv or the environment; everything comes from here.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.strategies import Strategy


@dataclass(frozen=True)
class SyncOptions:
    """Planning knobs (every driver and the dry run read the same ones)."""

    group_size: int = 1
    """Decoder blocks per group (strategies grouping by blocks: v3)."""
    lookahead: int = 1
    """Groups a trainer rank may gather ahead of the oldest group not yet released (strategies that gather ahead)."""
    direct: bool = True
    """Read regions that lie in a trainer rank's raw shard straight from its arena (strategies allowing it)."""
    reuse: bool = True
    """Dry-run the loader over one template layer per kind and stage, renamed for the others."""


class Side(enum.StrEnum):
    TRAINER = "trainer"
    ENGINE = "engine"


@dataclass(frozen=True)
class Fault:
    """A rank killed at a named point of the driver, deterministically whatever the sync's length.

    ``during=False``: before sync ``sync`` starts. ``during=True``: in the middle of it, once about half of the
    rank's work of that sync is done (an engine rank: after half its pulls finished; a trainer rank: after half its
    groups were published). ``target`` is an engine *replica* (its first rank dies; the driver takes the rest of the
    replica out and it rejoins at the next sync) or a trainer *rank* (the run cannot continue: it ends in one
    line). Syncs count from 1 within each strategy.
    """

    target: int
    sync: int
    during: bool = False
    side: Side = Side.ENGINE

    @classmethod
    def parse(cls, text: str, side: Side = Side.ENGINE) -> Fault:
        """``N@SYNC`` (killed before that sync) or ``N@SYNC:mid`` (killed during it)."""
        body, _, when = text.partition(":")
        target, sep, sync = body.partition("@")
        what = "REPLICA" if side is Side.ENGINE else "RANK"
        try:
            if not sep or when not in ("", "mid"):
                raise ValueError
            fault = cls(int(target), int(sync), when == "mid", side)
        except ValueError:
            raise KvmoveError(f"--fail-{side} {text!r} is not {what}@SYNC or {what}@SYNC:mid") from None
        if fault.target < 0 or fault.sync < 1:
            raise KvmoveError(f"--fail-{side} {text!r}: {what} counts from 0 and SYNC from 1")
        return fault

    def label(self) -> str:
        return f"{'replica' if self.side is Side.ENGINE else 'trainer rank'} {self.target}"


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def parse_devices(text: str, flag: str) -> tuple[str, ...]:
    """``"cuda:0,cuda:1"`` -> devices, cycled over the ranks of one side; bad names are one clear line."""
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in devices if not _DEVICE.match(d)]
    if bad or not devices:
        raise KvmoveError(f"{flag} {text!r}: devices are cpu, cuda or cuda:N, comma-separated")
    return devices


@dataclass(frozen=True)
class Placement:
    """Where the ranks run: the launcher that starts them (a key of ``kvmove.sync.launchers.LAUNCHERS``), the
    device of each rank (``*_devices`` are cycled over the ranks of that side) and the Ray cluster to join.

    ``colocated``: trainer and engine ranks share devices, as hybrid engines run RL (verl and the like): engine rank
    i runs on trainer rank i's device (``trainer_devices`` cycled), and ``engine_devices`` is not used.
    Disaggregated (the default): each side on its own devices.
    """

    launcher: str = "ray"
    trainer_devices: tuple[str, ...] = ("cpu",)
    engine_devices: tuple[str, ...] = ("cpu",)
    colocated: bool = False
    ray_address: str | None = None
    """Ray launcher: the cluster to join (None: a local Ray on loopback)."""

    def trainer_device(self, rank: int) -> str:
        return self.trainer_devices[rank % len(self.trainer_devices)]

    def engine_device(self, rank: int) -> str:
        if self.colocated:
            return self.trainer_device(rank)
        return self.engine_devices[rank % len(self.engine_devices)]

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disaggregated"

    def used_engine_devices(self) -> tuple[str, ...]:
        """The devices engine ranks run on (the trainer's where colocated)."""
        return self.trainer_devices if self.colocated else self.engine_devices

    @property
    def loopback(self) -> bool:
        """Whether every rank runs on this machine (sockets stay on 127.0.0.1): no Ray cluster, or one on loopback."""
        host = (self.ray_address or "127.0.0.1:0").removeprefix("ray://").rpartition(":")[0].strip("[]")
        return host in ("localhost", "::1") or host.startswith("127.")


SourceFactory = Callable[[Any], Any]
"""``SourceContext -> WeightSource`` (``kvmove.sync.ranks.source``); a module-level callable, so it pickles."""


@dataclass(frozen=True)
class SyncConfig:
    """Everything a run of syncs (or a dry run) needs."""

    model: ModelConfig
    trainer: TrainerLayout
    engine: EngineLayout
    strategies: tuple[Strategy, ...]
    transport: str = "auto"
    syncs: int = 1
    verify: bool = False
    seed: int = 0
    options: SyncOptions = field(default_factory=SyncOptions)
    placement: Placement = field(default_factory=Placement)
    faults: tuple[Fault, ...] = ()
    slow_replicas: tuple[tuple[int, float], ...] = ()
    """(replica, seconds): that replica's ranks sleep this long before each group (a straggler)."""
    deadline_s: float = 60.0
    """Seconds without progress before a peer is declared gone (every wait has this deadline)."""
    engine_kind: str = "reference"
    source: SourceFactory | None = None
    """Builds each trainer rank's WeightSource (None: kvmove's seeded Megatron shards, ``ShardedSource``)."""
    tensor_format: str = "hf"
    """How the source names and shapes its tensors (a key of ``kvmove.sync.planning.formats.FORMATS``): "hf", or
    "megatron"/"megatron-sequential" (megatron-core's own tensors, converted to HF names by the engines' plans)."""
    delta: bool = False
    """Delta syncs (``kvmove.sync.delta``): a packed pull moves only the words that changed since the engine rank's
    last sync, where that is smaller; dense for a first sync, a rejoined engine, a full sync."""
    full_every: int = 0
    """Delta syncs: every ``full_every``-th sync of a strategy is a full (dense) one (0: only where needed)."""
    reference: str | None = None
    """Verification reference: a directory template (``{version}`` is the training step) of HF safetensors
    checkpoints the trainer saved itself (None: the seeded checkpoint of ``seed`` and the step)."""
