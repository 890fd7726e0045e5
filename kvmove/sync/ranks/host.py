"""A rank's process side (a *host*): what a launcher starts, and what answers every command the rank gets.

Both launchers run the same hosts: a Ray actor forwards each actor call to ``handle``; a plain process serves
``handle`` on its control server, which engine ranks use too (they reach trainer ranks by address whatever
launched them). Handlers are methods marked ``@handles(CommandType)``; a subclass overrides one by marking its
own method for the same command type (the vLLM engine host does). :class:`RankSpec` is all a host starts from.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from kvmove.errors import KvmoveError
from kvmove.sync.config import Side, SyncConfig
from kvmove.sync.ranks.control import Address, EngineStats, RankMemory, ReportMemory, TrainerStats
from kvmove.sync.ranks.wire import ControlServer, node_address
from kvmove.transport import Membership, Transport, get_transport


@dataclass(frozen=True)
class RankSpec:
    """What the process of one rank starts from (picklable; the launcher fills it)."""

    side: Side
    rank: int
    config: SyncConfig
    """The run's config, with ``transport`` already resolved to a concrete name."""
    device: str
    authkey: bytes
    """The run's secret: control connections authenticate with it."""
    bind: str | None = "127.0.0.1"
    """Host the control server listens on (None: this node's routable address, for ranks spanning machines)."""
    membership: Membership | None = None
    """This rank's place in the transport's group (transports with ``group_member``)."""
    owns_process: bool = True
    """The process is the rank's own (a launcher started it): the host sets its torch threads and CUDA device.
    False for a rank hosted in a framework's own process (a trainer's), whose settings are the framework's."""


C = TypeVar("C", bound=Callable[..., Any])
S = TypeVar("S", TrainerStats, EngineStats)


def handles(command: type) -> Callable[[C], C]:
    """Mark a host method as the handler of ``command`` (one per type; subclasses may override)."""

    def mark(method: C) -> C:
        method._kvmove_handles = command  # type: ignore[attr-defined]
        return method

    return mark


class Host:
    """Base of trainer and engine hosts: command dispatch, control server, memory reports."""

    _handlers: ClassVar[dict[type, Callable[..., Any]]] = {}
    daemon: ClassVar[bool] = True
    """The processes launcher starts the rank's process as a daemon; False for a host whose engine starts
    processes of its own (vLLM's engine core: a daemonic process may have no children)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type, Callable[..., Any]] = {}
        for klass in reversed(cls.__mro__):
            for attr in vars(klass).values():
                command = getattr(attr, "_kvmove_handles", None)
                if command is not None:
                    table[command] = attr
        cls._handlers = table

    def __init__(self, spec: RankSpec) -> None:
        self.spec, self.config = spec, spec.config
        if spec.owns_process:
            torch.set_num_threads(1)
            if spec.device.startswith("cuda"):
                torch.cuda.set_device(torch.device(spec.device))
        bind = node_address(loopback=False) if spec.bind is None else spec.bind
        self.server = ControlServer(self.handle, bind, spec.authkey)

    @property
    def address(self) -> Address:
        """Where this rank's control server listens (engine ranks reach trainer ranks here)."""
        return self.server.address

    def handle(self, command: Any) -> Any:
        """Run the handler of ``command``'s type and return its reply."""
        method = self._handlers.get(type(command))
        if method is None:
            raise KvmoveError(f"{type(self).__name__} has no handler for {type(command).__name__}")
        return method(self, command)

    def open_transport(self) -> Transport:
        """This rank's transport endpoint (the name in the spec's config is resolved already)."""
        return get_transport(self.config.transport).open(self.spec.membership, self.spec.device)

    @handles(ReportMemory)
    def memory(self, _: ReportMemory) -> RankMemory:
        return RankMemory(str(self.spec.side), self.spec.rank, os.getpid(), rss_bytes(), peak_rss_bytes())

    def close(self) -> None:
        self.server.close()


def finished(stats: S, cpu_start: float) -> S:
    """A rank's sync stats with what its process spent: resident memory now, and the CPU seconds of every thread
    since ``cpu_start`` (``time.process_time()`` when the rank's part of the sync began). On a host whose cores
    every rank shares (CPU syncs), these say how much of a sync's time was work and how much waiting."""
    return stats._replace(rss_bytes=rss_bytes(), cpu_seconds=time.process_time() - cpu_start)


def rss_bytes() -> int:
    """Resident memory of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_freed_memory() -> None:
    """Free what a sync's temporaries left behind, and give it back to the OS (the trim is glibc only).

    NOTE: a verification builds a fresh reference model per sync, and engine models hold reference cycles
    (parameters keep their module's bound loader), so each one lived until the cyclic collector happened to run,
    and glibc kept the freed heap: engine ranks grew by tens of MB per verified sync (25 MB on qwen3-moe-small).
    Collecting, then trimming, after each verification (and after each trainer step) keeps them flat.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def die_after(count: int | None) -> Callable[[int], None] | None:
    """Fault hook: a callback that kills this process (as a crash would) once it is called with ``count``."""
    if count is None:
        return None

    def hook(n: int) -> None:
        if n >= count:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
