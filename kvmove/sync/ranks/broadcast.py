"""The broadcast baseline's two halves: trainer rank 0 broadcasts every full tensor, in the engine's format (an FP8
engine's tensors are quantized whole on rank 0 first: FP8 weights and scales cross the link); engine ranks receive
the whole model, then run their own loader over it (each keeps its slice and drops the rest).

The process group is opened once and kept (:class:`KeptGroup`), as an RL framework initializes its weight-update
group once and broadcasts over it at every sync; the driver names a new group when the live engine ranks change,
at an address where trainer rank 0 already hosts the group's store (``HostBroadcastStore``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import nn

from kvmove.engines import EngineAdapter
from kvmove.models.tensors import TensorMeta
from kvmove.sync.ranks.calltimes import CallTimes
from kvmove.sync.ranks.control import Address, BroadcastGroup, EngineStats, TrainerStats
from kvmove.sync.ranks.source import WeightSource
from kvmove.sync.strategies import Gather


class OpenedGroup(NamedTuple):
    """One member's TCP store (member 0 hosts it) and torch.distributed process group of a broadcast."""

    store: Any
    group: Any


def host_store(host: str, timeout_s: float) -> tuple[Address, Any]:
    """A TCP store listening from now on, on a free port of ``host`` (the OS picks it): (its address, the store)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return Address(host, int(store.port)), store


def open_group(group: BroadcastGroup, member: int, device: str, timeout_s: float, store: Any = None) -> OpenedGroup:
    """(store, process group) of ``member``: NCCL for CUDA buffers, else gloo; member 0 hosts the store (``store``:
    the one it already hosts at the group's address, else it opens it here)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    host, port = group.store
    if store is None:
        store = dist.TCPStore(host, port, group.size, member == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(group.prefix, store)
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return OpenedGroup(store, dist.ProcessGroupNCCL(prefixed, member, group.size, options))
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return OpenedGroup(store, dist.ProcessGroupGloo(prefixed, member, group.size, gloo))


class KeptGroup:
    """One member's broadcast group, kept from sync to sync: :meth:`get` opens the group a command names the first
    time, and again only when a command names another (the driver names a new one when a replica is lost or
    rejoins); the old one is dropped then."""

    def __init__(self) -> None:
        self._named: BroadcastGroup | None = None
        self._opened: OpenedGroup | None = None
        self._hosted: tuple[Address, Any] | None = None

    def host(self, host: str, timeout_s: float) -> Address:
        """Member 0: open the next group's store now (:func:`host_store`) and keep it for the group named at its
        address; a store hosted before and never named goes."""
        self._hosted = host_store(host, timeout_s)
        return self._hosted[0]

    def get(self, group: BroadcastGroup, member: int, device: str, timeout_s: float) -> Any:
        """The process group of ``group`` as ``member`` (opened here when it is not the kept one)."""
        if self._opened is None or group != self._named:
            self._opened = None  # NOTE: the old group's store and connections go before the new one opens
            store = None
            if member == 0 and self._hosted is not None and self._hosted[0] == tuple(group.store):
                store, self._hosted = self._hosted[1], None
            self._opened, self._named = open_group(group, member, device, timeout_s, store), group
        return self._opened.group


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).view(-1)


Convert = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
"""Full BF16 tensors -> the engine's checkpoint tensors (kvmove.models.checkpoint.engine_checkpoint)."""


def send_all(
    source: WeightSource,
    rank: int,
    pg: Any | None,
    published: Callable[[int], None] | None = None,
    convert: Convert = dict,
) -> TrainerStats:
    """Every trainer rank gathers each tensor onto rank 0 (collective); rank 0 (``pg`` set) puts it in the
    engine's format with ``convert`` and broadcasts the result, tensor by tensor in the engine's checkpoint order."""
    start = time.perf_counter()
    calls0 = source.collective_calls
    gather = send = 0.0
    sent = peak = 0
    calls = CallTimes()
    if published is not None:
        published(0)
    for n, meta in enumerate(source.metadata(), start=1):
        t0 = time.perf_counter()
        (gathered,) = source.materialize([meta.name], Gather.ROOT)
        gather += time.perf_counter() - t0
        if pg is not None and gathered.tensor is not None:
            t1 = time.perf_counter()
            nbytes = 0
            for tensor in convert({meta.name: gathered.tensor}).values():
                pg.broadcast(_flat(tensor), 0).wait()
                nbytes += tensor.numel() * tensor.element_size()
            if gathered.tensor.is_cuda:
                torch.cuda.current_stream(gathered.tensor.device).synchronize()
            seconds = time.perf_counter() - t1
            send, sent, calls = send + seconds, sent + nbytes, calls.add(nbytes, seconds)
            peak = max(peak, meta.nbytes)
        if published is not None:
            published(n)
    return TrainerStats(
        rank,
        time.perf_counter() - start,
        gather,
        0.0,
        send,
        sent,
        0,
        peak,
        source.collective_calls - calls0,
        send_calls=calls,
    )


def receive_all(
    metas: Sequence[TensorMeta],
    pg: Any,
    adapter: EngineAdapter,
    model: nn.Module,
    rank: int,
    device: str = "cpu",
    to_hf: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]] = lambda ws: ws,
) -> EngineStats:
    """Receive every full tensor the trainer broadcasts (``metas``, in order; the whole model is materialized
    here), then load it with the engine's loader (``to_hf`` converts tensors of another checkpoint format to the
    engine's checkpoint first)."""
    start = time.perf_counter()
    received: list[tuple[str, torch.Tensor]] = []
    transfer = 0.0
    for meta in metas:
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        t0 = time.perf_counter()
        pg.broadcast(_flat(buf), 0).wait()
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        transfer += time.perf_counter() - t0
        received.append((meta.name, buf))
    t1 = time.perf_counter()
    adapter.load_weights(model, to_hf(received))
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    load = time.perf_counter() - t1
    total = sum(t.numel() * t.element_size() for _, t in received)
    return EngineStats(rank, time.perf_counter() - start, 0.0, transfer, load, total, len(received), total)
