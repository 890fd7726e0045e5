"""The processes launcher: one ``torch.multiprocessing`` (spawn) process per rank, on its device, no Ray.

Each process builds its host and reports the address of its control server; the driver then sends commands
over authenticated TCP connections (a pool per rank, so several commands can be in flight, as with Ray actors).
A process exits when the driver closes its start pipe or goes away, so nothing outlives the run. Rank processes are
daemons, except for hosts that start processes of their own (``Host.daemon``: vLLM's engine core).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Sequence
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

import torch.multiprocessing as mp

from kvmove.errors import KvmoveError
from kvmove.sync.config import Side
from kvmove.sync.launchers.base import Call, Launcher, RankDied, RankHandle
from kvmove.sync.ranks.control import Address, Failure
from kvmove.sync.ranks.host import Host, RankSpec
from kvmove.sync.ranks.wire import ControlClient, RankUnreachable, answer, unwrap

START_TIMEOUT_S = 600.0


def serve_rank(host_cls: type[Host], spec: RankSpec, pipe: Any) -> None:
    """A rank process: build the host, report its address (or why it could not start), serve until told to stop."""
    os.dup2(2, 1)  # NOTE: a rank prints nothing for scripts: its libraries' output (NIXL, UCX, NCCL) goes to stderr
    host = answer(host_cls, spec)  # the host, or a Failure saying why it could not start
    pipe.send(host if isinstance(host, Failure) else host.address)
    if isinstance(host, Failure):
        return
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()  # NOTE: returns (or raises EOFError) when the driver stops this rank or exits
    host.close()
    # NOTE: os._exit skips interpreter shutdown, so run multiprocessing's finalizers first: they unlink what the rank's
    # libraries registered with the resource tracker (a semaphore tqdm makes when save_pretrained shows progress)
    mp_util._run_finalizers(0)  # type: ignore[attr-defined]
    os._exit(0)  # transport and process-group threads may still be blocked on peers that are gone


class ProcessRank(RankHandle):
    def __init__(self, spec: RankSpec, process: Any, pipe: Any) -> None:
        super().__init__(spec)
        self.process, self.pipe = process, pipe
        self.address: Address | None = None
        self._idle: list[ControlClient] = []

    def submit(self, command: Any) -> ProcessCall:
        if self.address is None:
            raise RankDied(f"{self.label} did not start")
        try:
            client = self._idle.pop() if self._idle else self._connect()
            client.send(command)
        except RankUnreachable as exc:
            raise RankDied(f"{self.label} is gone ({exc})") from None
        return ProcessCall(self, command, client)

    def _connect(self) -> ControlClient:
        assert self.address is not None
        return ControlClient(self.address, self.spec.authkey, self.label, self.spec.config.deadline_s + 30)

    def release(self, client: ControlClient) -> None:
        self._idle.append(client)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the process to exit, wait a little, then kill it."""
        for client in self._idle:
            client.close()
        self._idle.clear()
        with contextlib.suppress(OSError):
            self.pipe.close()
        self.process.join(timeout=timeout_s)
        self.kill()


class ProcessCall(Call):
    def __init__(self, rank: ProcessRank, command: Any, client: ControlClient) -> None:
        super().__init__(rank, command)
        self.client = client


class ProcessLauncher(Launcher):
    """Ranks as plain local processes (the GPU machine has no Ray; see the module docstring)."""

    actors = False

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._ctx = mp.get_context("spawn")
        self.ranks: list[ProcessRank] = []
        # NOTE: multiprocessing joins non-daemonic children at exit, and a rank waits for its start pipe to close:
        # this runs first (atexit is last in, first out) and closes every rank a crashed driver left open
        atexit.register(_close_at_exit, weakref.ref(self))

    def start(self, ranks: Sequence[tuple[type[Host], RankSpec]]) -> list[RankHandle]:
        started = []
        for host, spec in ranks:
            parent, child = self._ctx.Pipe()
            process = self._ctx.Process(target=serve_rank, args=(host, spec, child), daemon=host.daemon)
            process.start()
            child.close()
            started.append(ProcessRank(spec, process, parent))
        self.ranks += started
        for rank in started:  # NOTE: every process starts before any is waited for (group transports meet)
            rank.address = self._started(rank)
        return list(started)

    def _started(self, rank: ProcessRank) -> Address:
        try:
            if not rank.pipe.poll(START_TIMEOUT_S):
                raise KvmoveError(f"{rank.label} did not start within {START_TIMEOUT_S:.0f} s")
            reply = rank.pipe.recv()
        except (EOFError, OSError):
            raise RankDied(f"{rank.label} exited while starting (exit code {rank.process.exitcode})") from None
        address: Address = unwrap(reply, rank.label)
        return address

    def wait(self, calls: Sequence[Call], timeout_s: float) -> list[Call]:
        by_fd = {c.client.fileno(): c for c in calls if isinstance(c, ProcessCall)}
        ready = wait_connections([c.client.connection for c in by_fd.values()], timeout=timeout_s)
        return [by_fd[c.fileno()] for c in ready if isinstance(c, Connection)]

    def _fetch(self, call: Call) -> Any:
        assert isinstance(call, ProcessCall) and isinstance(call.rank, ProcessRank)
        try:
            value = call.client.receive(timeout_s=0)
        except RankUnreachable:
            call.client.close()
            raise RankDied(f"{call.rank.label} died ({_exit(call.rank)})") from None
        except BaseException:
            call.rank.release(call.client)
            raise
        call.rank.release(call.client)
        return value

    def close(self) -> None:
        for rank in sorted(self.ranks, key=lambda r: r.spec.side is Side.TRAINER):
            rank.stop()
        self.ranks.clear()


def _close_at_exit(launcher: weakref.ref[ProcessLauncher]) -> None:
    alive = launcher()
    if alive is not None:
        alive.close()


def _exit(rank: ProcessRank) -> str:
    rank.process.join(timeout=1)
    code = rank.process.exitcode
    return "still running" if code is None else f"killed by signal {-code}" if code < 0 else f"exit code {code}"
