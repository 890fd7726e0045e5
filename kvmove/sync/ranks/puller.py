"""An engine rank's puller, built from a picklable :class:`~kvmove.sync.ranks.control.PullerInit` in any process.

``open_puller`` is init step 5 on the engine side: it allocates and registers the receive slots and the
parameters direct pulls write, connects the transport to every source trainer rank, prepares every batch of direct
reads (peer access, copy plans, NIXL requests) and the programs landing each packed pull (a first sync then
costs what the next ones do) and opens two control connections to each, by address (pack requests, answered in
order; finish notes, on their own connection so a pack waiting for its group never holds up the note that
releases an earlier one). Nothing here needs Ray, so a process that is not a launched rank (e.g. a worker
inside an inference engine) can pull too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.sync.planning.packing import pack_layout
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.planning.schedule import PullPlan
from kvmove.sync.ranks.control import EngineStats, Finish, Pack, Packed, PullerInit, TrainerEndpoint
from kvmove.sync.ranks.engine import EngineRank
from kvmove.sync.ranks.wire import ControlClient
from kvmove.sync.strategies import Strategy
from kvmove.transport import BufferDesc, EndpointInfo, Transport, get_transport
from kvmove.transport.base import PendingReads, Read


class TrainerLinks:
    """The control half of a ``TrainerClient``: two authenticated connections per source trainer rank."""

    def __init__(self, init: PullerInit) -> None:
        self.engine, self.timeout_s = init.engine, init.deadline_s
        self.packs: dict[int, ControlClient] = {}
        self.notes: dict[int, ControlClient] = {}
        try:
            for t, link in init.trainers.items():
                who = f"trainer rank {t}"
                self.packs[t] = ControlClient(link.control, init.authkey, who, init.deadline_s + 5)
                self.notes[t] = ControlClient(link.control, init.authkey, who, init.deadline_s + 5)
        except BaseException:
            self.close()
            raise

    def request(self, trainer: int, sync_id: int, strategy: str, pull_id: int, dense: bool = False) -> int:
        self.packs[trainer].send(Pack(sync_id, strategy, self.engine, pull_id, self.timeout_s, dense))
        return trainer

    def wait(self, handle: int) -> Packed:
        reply = self.packs[handle].receive()  # NOTE: replies come back in request order on each connection
        return Packed(*reply)

    def finish(self, trainer: int, sync_id: int, strategy: str, group: int, slot: int, read_s: float = -1.0) -> None:
        self.notes[trainer].send(Finish(sync_id, strategy, group, self.engine, slot, read_s))

    def close(self) -> None:
        for conn in (*self.packs.values(), *self.notes.values()):
            conn.close()


class ByteReader:
    """The data half of a ``TrainerClient``: reads trainer slots and arenas into registered local memory."""

    def __init__(
        self,
        transport: Transport,
        trainers: Mapping[int, TrainerEndpoint],
        recv: Mapping[str, Sequence[BufferDesc]],
        params: Mapping[str, BufferDesc],
    ) -> None:
        self.transport, self.trainers, self.recv, self.params = transport, trainers, recv, params
        self._slot_ranges: dict[tuple[str, int, int, int, int], np.ndarray] = {}

    def read(self, strategy: str, trainer: int, slot: int, recv: int, nbytes: int) -> float:
        r = self.slot_read(strategy, trainer, slot, recv, nbytes)
        return self.transport.read(r.remote, r.local, r.ranges).seconds

    def slot_read(self, strategy: str, trainer: int, slot: int, recv: int, nbytes: int) -> Read:
        """The read of a packed pull's ``nbytes`` from ``trainer``'s serve slot into receive slot ``recv``; its
        ranges are one array per such read, so the read prepared at init is the one a sync makes."""
        key = (strategy, trainer, slot, recv, nbytes)
        ranges = self._slot_ranges.get(key)
        if ranges is None:
            ranges = self._slot_ranges[key] = np.array([[0, 0, nbytes]], dtype=np.int64)
        return Read(self.trainers[trainer].slots[strategy][slot], self.recv[strategy][recv], ranges)

    def reads(self, pulls: Sequence[tuple[int, Sequence[tuple[str, Any]]]]) -> list[Read]:
        """The reads of direct pulls: (trainer, (parameter, byte spans) runs) -> one read per parameter."""
        out = []
        for trainer, spans in pulls:
            arena = self.trainers[trainer].arena
            if arena is None:
                raise KvmoveError(
                    f"trainer rank {trainer} registered no arena, so nothing can be read from it directly"
                )
            out += [Read(arena, self.params[name], runs) for name, runs in spans]
        return out

    def start_direct(self, pulls: Sequence[tuple[int, Sequence[tuple[str, Any]]]]) -> PendingReads:
        return self.transport.start_reads(self.reads(pulls))

    def prepare(self, init: PullerInit) -> None:
        """Warm start: prepare, at init, every batch of direct reads a sync may start (each pull's alone, and every
        pull of a strategy at once) and every read of a packed pull (each serve slot it may be packed into, into
        each receive slot), so the first sync costs what the next ones do."""
        for strategy, pulls in init.pulls.items():
            direct = [(p.trainer, p.direct) for p in pulls.pulls if p.direct]
            for batch in ([d] for d in direct):
                self.transport.prepare(self.reads(batch))
            if len(direct) > 1:
                self.transport.prepare(self.reads(direct))
            for trainer, nbytes in packed_reads(pulls):
                for slot in range(len(self.trainers[trainer].slots.get(strategy, ()))):
                    for recv in range(len(self.recv.get(strategy, ()))):
                        self.transport.prepare([self.slot_read(strategy, trainer, slot, recv, nbytes)])


def packed_reads(pulls: PullPlan) -> set[tuple[int, int]]:
    """(trainer rank, bytes) of the reads of ``pulls``' packed pulls: a packed pull's bytes with the 16-byte
    alignment of each part, as the trainer's ``pack`` lays them out."""
    if pulls.plan is None:
        return set()
    entries = pulls.plan.entries
    return {
        (p.trainer, pack_layout([n for k in p.entries for n in entries[k].sizes]).nbytes)
        for p in pulls.pulls
        if p.packed and p.entries
    }


class _Client:
    """``TrainerClient`` of one sync: control links plus byte reads, for one strategy."""

    def __init__(self, links: TrainerLinks, reader: ByteReader, strategy: str) -> None:
        self.links, self.reader, self.strategy = links, reader, strategy

    def request(self, trainer: int, sync_id: int, pull_id: int, dense: bool = False) -> Any:
        return self.links.request(trainer, sync_id, self.strategy, pull_id, dense)

    def wait(self, handle: Any) -> Packed:
        return self.links.wait(handle)

    def read(self, trainer: int, slot: int, recv: int, nbytes: int) -> float:
        return self.reader.read(self.strategy, trainer, slot, recv, nbytes)

    def start_direct(self, pulls: Sequence[tuple[int, Sequence[tuple[str, Any]]]]) -> Any:
        return self.reader.start_direct(pulls)

    def wait_direct(self, handle: Any) -> float:
        return float(handle.wait().seconds)

    def finish(self, trainer: int, sync_id: int, group: int, slot: int, read_s: float = -1.0) -> None:
        self.links.finish(trainer, sync_id, self.strategy, group, slot, read_s)


class Puller:
    """One engine rank's receiving side after init: pulls a sync's regions into its parameters."""

    def __init__(self, init: PullerInit, rank: EngineRank, reader: ByteReader, links: TrainerLinks) -> None:
        self.init, self.rank, self.reader, self.links = init, rank, reader, links

    def endpoint_info(self) -> EndpointInfo:
        return self.reader.transport.endpoint_info()

    def run(
        self, sync_id: int, strategy: Strategy, delay_s: float = 0.0, pulled: Callable[[int], None] | None = None
    ) -> EngineStats:
        """This rank's pulls of sync ``sync_id`` under ``strategy``; ``pulled(n)`` after the n-th (fault hook)."""
        client = _Client(self.links, self.reader, strategy.name)
        pulls = self.init.pulls[strategy.name]
        self.reader.transport.take_executed()
        self.rank.take_mapped_bytes()
        stats = self.rank.run_sync(sync_id, strategy, pulls, client, delay_s=delay_s, pulled=pulled)
        executed = self.reader.transport.take_executed()
        if mapped := self.rank.take_mapped_bytes():  # FP8 bytes this rank quantized from mapped arenas
            executed[MAPPED_EXECUTOR] = mapped
        return stats._replace(copy_executors=executed)

    def close(self) -> None:
        self.links.close()


MAPPED_EXECUTOR = "mapped-quantize"
"""The name a sync's stats give the FP8 bytes an engine rank quantized itself from mapped arenas (next to the
transport's copy executors: what moved those bytes)."""


def mapped_arenas(
    transport: Transport, trainers: Mapping[int, TrainerEndpoint], pulls: Iterable[PullPlan]
) -> dict[int, torch.Tensor]:
    """The arenas of the trainer ranks some mapped pull quantizes from, mapped into this process (once, at init);
    a clear error where the transport cannot map them or a trainer rank registered no arena."""
    out = {}
    for trainer in sorted({p.trainer for pp in pulls for p in pp.pulls if p.mapped}):
        arena = trainers[trainer].arena
        if arena is None:
            raise KvmoveError(f"trainer rank {trainer} registered no arena, so no engine can quantize from it")
        out[trainer] = transport.mapped(arena)
    return out


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


def open_puller(
    init: PullerInit,
    model: nn.Module,
    plan: ShardingPlan,
    *,
    transport: Transport | None = None,
    device: str | torch.device = "cpu",
    rank: Callable[[nn.Module, ShardingPlan, Mapping[str, Sequence[torch.Tensor]]], EngineRank] = EngineRank,
) -> Puller:
    """Init step 5 on the engine side, once (see the module docstring). ``model`` is what the pulls write (its
    parameters are the plan's ``params``); ``transport``: this process's endpoint (None: open one from ``init``);
    ``rank``: builds the receiving side (an engine that lands pulls its own way, e.g. staged, passes its own)."""
    transport = transport or get_transport(init.transport).open(init.membership, str(device))
    recv = {
        s: [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(k)] for s, (k, n) in init.recv_sizes.items()
    }
    descs = {s: [transport.register(t) for t in ts] for s, ts in recv.items()}
    params = register_params(transport, model, init.direct_params)
    endpoints = {t: link.endpoint for t, link in init.trainers.items()}
    for ep in endpoints.values():
        transport.connect(ep.info)
    reader = ByteReader(transport, endpoints, descs, params)
    reader.prepare(init)
    receiver = rank(model, plan, recv)
    receiver.map_arenas(mapped_arenas(transport, endpoints, init.pulls.values()))
    for strategy, pulls in init.pulls.items():
        receiver.prepare(strategy, pulls)
    return Puller(init, receiver, reader, TrainerLinks(init))
