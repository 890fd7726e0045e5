"""An engine rank during syncs: pull each group's packed regions from their trainer ranks and load them.

Pulls go group by group, in plan order. A packed pull asks the trainer rank to pack, reads the slot and
signals ``done`` so that trainer rank can release the group; with ``pipelined`` (v3) the next packed pull is
requested before the current one is read, and a loader thread copies group g into the parameters while group
g+1 is being pulled (double-buffered receive slots); otherwise each pull is loaded before the next one starts.
A direct pull reads straight from the trainer rank's arena into the parameters: no request, no load.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.sync.packing import unpack
from kvmove.sync.plan import Region, ShardingPlan
from kvmove.sync.schedule import PullPlan
from kvmove.transport import BufferDesc, EndpointInfo, Transport


class TrainerClient(Protocol):
    """How an engine rank reaches trainer ranks (Ray actor calls plus a transport, in practice)."""

    def request(self, trainer: int, sync_id: int, pull_id: int) -> Any:
        """Ask ``trainer`` to pack pull ``pull_id``; returns a handle for :meth:`wait` (does not block)."""

    def wait(self, handle: Any) -> tuple[int, int]:
        """The (slot, nbytes) of a requested pull, once the trainer has packed it."""

    def read(self, trainer: int, slot: int, recv: int, nbytes: int) -> float: ...
    def read_direct(self, trainer: int, spans: Sequence[tuple[str, Any]]) -> float:
        """Read (parameter, byte spans) runs from ``trainer``'s arena into the registered parameters; seconds."""

    def finish(self, trainer: int, sync_id: int, group: int, slot: int) -> None:
        """Free the trainer's slot and tell it this engine has all it pulls of ``group`` from it."""


class TrainerEndpoint(NamedTuple):
    """What an engine rank needs to read a trainer rank's bytes: its endpoint, serve slots and arena."""

    info: EndpointInfo
    slots: dict[str, list[BufferDesc]]
    arena: BufferDesc | None


class ByteReader:
    """The data half of a :class:`TrainerClient`: reads trainer slots and arenas into registered local memory."""

    def __init__(
        self,
        transport: Transport,
        trainers: Mapping[int, TrainerEndpoint],
        recv: Mapping[str, Sequence[BufferDesc]],
        params: Mapping[str, BufferDesc],
        strategy: str,
    ) -> None:
        self.transport, self.trainers, self.recv, self.params = transport, trainers, recv, params
        self.strategy = strategy

    def read(self, trainer: int, slot: int, recv: int, nbytes: int) -> float:
        remote = self.trainers[trainer].slots[self.strategy][slot]
        return self.transport.read(remote, self.recv[self.strategy][recv], [(0, 0, nbytes)]).seconds

    def read_direct(self, trainer: int, spans: Sequence[tuple[str, Any]]) -> float:
        arena = self.trainers[trainer].arena
        if arena is None:
            raise KvmoveError(f"trainer rank {trainer} registered no arena, so nothing can be read from it directly")
        return sum(self.transport.read(arena, self.params[name], runs).seconds for name, runs in spans)


def register_params(transport: Transport, model: nn.Module, names: Sequence[str]) -> dict[str, BufferDesc]:
    """Register parameters ``names`` of ``model`` (as flat bytes) for direct pulls; once, at init."""
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        data = params[name].data
        if not data.is_contiguous():
            raise KvmoveError(f"parameter {name} is not contiguous; it cannot receive direct pulls")
        out[name] = transport.register(data.view(-1).view(torch.uint8))
    return out


class EngineSide(NamedTuple):
    """An engine rank after init step 5: its receiving side and the descriptors of what it registered."""

    rank: EngineRank
    recv: dict[str, list[BufferDesc]]
    params: dict[str, BufferDesc]


def open_engine_rank(
    transport: Transport,
    model: nn.Module,
    plan: ShardingPlan,
    recv_sizes: Mapping[str, tuple[int, int]],
    direct_params: Sequence[str],
    trainers: Mapping[int, TrainerEndpoint],
    device: str | torch.device = "cpu",
) -> EngineSide:
    """Init step 5 on the engine side, once: allocate and register ``count`` receive slots of ``nbytes`` per
    strategy and the parameters direct pulls write, then connect to every source trainer rank."""
    recv = {s: [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(k)] for s, (k, n) in recv_sizes.items()}
    descs = {s: [transport.register(t) for t in ts] for s, ts in recv.items()}
    params = register_params(transport, model, direct_params)
    for ep in trainers.values():
        transport.connect(ep.info)
    return EngineSide(EngineRank(model, plan, recv), descs, params)


class EngineStats(NamedTuple):
    rank: int
    seconds: float
    request_seconds: float
    transfer_seconds: float
    load_seconds: float
    bytes_received: int
    pulls: int
    peak_extra_bytes: int


class EngineRank:
    """Receiving side of one engine rank: its model's parameters, plan and registered receive slots."""

    def __init__(self, model: nn.Module, plan: ShardingPlan, recv: Mapping[str, Sequence[torch.Tensor]]) -> None:
        self.model, self.plan = model, plan
        self.recv = {strategy: list(r) for strategy, r in recv.items()}
        self.params = dict(model.named_parameters())

    def recv_bytes(self, strategy: str) -> int:
        return sum(r.numel() for r in self.recv.get(strategy, ()))

    def load(self, regions: Sequence[Region], buf: torch.Tensor) -> None:
        for region, data in zip(regions, unpack(buf, regions), strict=True):
            region.dst.apply(self.params[region.param].data).copy_(data, non_blocking=True)
        if buf.is_cuda:  # the slot is reusable, and the time real, only once the copies ran
            torch.cuda.current_stream(buf.device).synchronize()

    def run_sync(
        self,
        sync_id: int,
        strategy: str,
        pulls: PullPlan,
        client: TrainerClient,
        *,
        pipelined: bool,
        delay_s: float = 0.0,
    ) -> EngineStats:
        start = time.perf_counter()
        order = sorted(range(len(pulls.pulls)), key=lambda i: pulls.pulls[i].group)
        packed = [i for i in order if not pulls.pulls[i].direct]
        recv = self.recv.get(strategy, [])
        loader = _Loader(self, recv) if pipelined and packed else None
        # NOTE: pipelined syncs keep one request ahead, so the trainer packs pull k+1 while we read pull k
        depth = 2 if pipelined else 1
        pending = deque((i, client.request(pulls.pulls[i].trainer, sync_id, i)) for i in packed[:depth])
        request = transfer = load = 0.0
        received = k = 0
        group: int | None = None
        try:
            for i in order:
                pull = pulls.pulls[i]
                if pull.group != group and delay_s:
                    time.sleep(delay_s)  # fault injection: a slow replica
                group = pull.group
                if pull.direct:
                    transfer += client.read_direct(pull.trainer, pull.direct)
                    received += pull.nbytes
                    continue
                j, handle = pending.popleft()
                assert j == i
                slot_index = k % len(recv)
                if loader is not None:
                    loader.wait_free(slot_index)
                t0 = time.perf_counter()
                slot, nbytes = client.wait(handle)
                request += time.perf_counter() - t0
                if k + depth < len(packed):
                    nxt = packed[k + depth]
                    pending.append((nxt, client.request(pulls.pulls[nxt].trainer, sync_id, nxt)))
                k += 1
                transfer += client.read(pull.trainer, slot, slot_index, nbytes)
                # NOTE: pulls are bucketed by (group, trainer), so this one pull is all of the group from it
                client.finish(pull.trainer, sync_id, pull.group, slot)
                received += nbytes
                regions = [self.plan.regions[r] for r in pull.regions]
                if loader is None:
                    t2 = time.perf_counter()
                    self.load(regions, recv[slot_index])
                    load += time.perf_counter() - t2
                else:
                    loader.submit(slot_index, regions)
        finally:
            if loader is not None:
                load += loader.close()
        return EngineStats(
            pulls.engine,
            time.perf_counter() - start,
            request,
            transfer,
            load,
            received,
            len(pulls.pulls),
            self.recv_bytes(strategy),
        )


class _Loader:
    """Background copier for pipelined syncs; tracks which receive slots still hold unloaded bytes."""

    def __init__(self, engine: EngineRank, recv: list[torch.Tensor]) -> None:
        self.engine, self.recv = engine, recv
        self.jobs: queue.Queue[tuple[int, list[Region]] | None] = queue.Queue()
        self.busy = [threading.Event() for _ in recv]
        for e in self.busy:
            e.set()
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.stream = torch.cuda.Stream(recv[0].device) if recv and recv[0].is_cuda else None
        self.thread = threading.Thread(target=self._run, name="kvmove-loader", daemon=True)
        self.thread.start()

    def wait_free(self, slot: int) -> None:
        self.busy[slot].wait()
        if self.error is not None:
            raise self.error

    def submit(self, slot: int, regions: list[Region]) -> None:
        self.busy[slot].clear()
        self.jobs.put((slot, regions))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            slot, regions = job
            t0 = time.perf_counter()
            try:
                if self.stream is not None:  # loads overlap the next read, which runs on the default stream
                    with torch.cuda.stream(self.stream):
                        self.engine.load(regions, self.recv[slot])
                else:
                    self.engine.load(regions, self.recv[slot])
            except BaseException as exc:  # surfaced to the puller at its next wait
                self.error = exc
            self.seconds += time.perf_counter() - t0
            self.busy[slot].set()

    def close(self) -> float:
        self.jobs.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds
