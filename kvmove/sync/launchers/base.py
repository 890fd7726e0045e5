"""The launcher interface: start rank hosts somewhere, carry typed commands to them, report deaths.

A launcher starts one host object per rank (``kvmove.sync.ranks.host``) in its own process and returns a
:class:`RankHandle` per rank; the driver sends commands with ``submit`` and collects replies with ``wait`` /
``result``. Replies are whatever the host's handler returned; a handler's error is raised by ``result`` as one
line, and a rank whose process died raises :class:`RankDied`. The two launchers differ only in how a process
is started and how a command reaches it; everything a rank does is the host's, the same in both.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from kvmove.errors import KvmoveError
from kvmove.sync.config import SyncConfig
from kvmove.sync.ranks.host import Host, RankSpec


class RankDied(KvmoveError):
    """A rank's process is gone (killed, crashed, or its connection closed)."""


class RankHandle(ABC):
    """One started rank."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec

    @property
    def label(self) -> str:
        return f"{self.spec.side} rank {self.spec.rank}"

    @abstractmethod
    def submit(self, command: Any) -> Call:
        """Send ``command``; returns at once (several calls to one rank may be in flight)."""

    @abstractmethod
    def kill(self) -> None:
        """End the rank's process now (as a crash would); idempotent."""


class Call:
    """A command in flight to one rank; ``launcher.result(call)`` gives its reply."""

    def __init__(self, rank: RankHandle, command: Any) -> None:
        self.rank, self.command = rank, command
        self.fetched = False
        self.value: Any = None
        self.error: BaseException | None = None

    @property
    def label(self) -> str:
        return f"{self.rank.label} ({type(self.command).__name__})"


class Launcher(ABC):
    """Starts the ranks of one run (see the module docstring)."""

    actors: ClassVar[bool] = False
    """Ranks are Ray actors (Ray-object transports need that)."""

    def __init__(self, config: SyncConfig) -> None:
        self.config = config

    @abstractmethod
    def start(self, ranks: Sequence[tuple[type[Host], RankSpec]]) -> list[RankHandle]:
        """Start one host per (host class, spec), all at once (a transport group needs every member starting)."""

    def started(self, ranks: Sequence[RankHandle]) -> None:  # noqa: B027 - most launchers need nothing here
        """Every rank of the run has been started (Ray builds collective groups over them here)."""

    @abstractmethod
    def wait(self, calls: Sequence[Call], timeout_s: float) -> list[Call]:
        """The calls among ``calls`` that finished (successfully or not) within ``timeout_s``, at least one if any."""

    def result(self, call: Call) -> Any:
        """The reply of a finished call; its handler's error as a one-line KvmoveError; RankDied if the rank died."""
        if not call.fetched:
            try:
                call.value = self._fetch(call)
            except Exception as exc:
                call.error = exc
            call.fetched = True
        if call.error is not None:
            raise call.error
        return call.value

    @abstractmethod
    def _fetch(self, call: Call) -> Any:
        """The reply of a finished call (once per call), raising as ``result`` documents."""

    def gather(self, calls: Sequence[Call], timeout_s: float) -> list[Any]:
        """Every call's reply, in order; the first failure is raised (the others are left to the caller's close)."""
        deadline = time.monotonic() + timeout_s
        pending = list(calls)
        while pending:
            ready = self.wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise KvmoveError(f"{pending[0].label} did not answer within {timeout_s:.0f} s")
            for call in ready:
                self.result(call)
                pending.remove(call)
        return [self.result(c) for c in calls]

    def call(self, ranks: Sequence[RankHandle], command: Any, timeout_s: float) -> list[Any]:
        """Send ``command`` to every rank of ``ranks`` at once, then collect every reply."""
        return self.gather([r.submit(command) for r in ranks], timeout_s)

    @abstractmethod
    def close(self) -> None:
        """End every rank this launcher started (engine ranks first: they may map trainer memory); idempotent."""
