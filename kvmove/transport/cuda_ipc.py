"""CUDA IPC: a reader maps the server's registered device buffers once and pulls them with device copies.

Same host only; the server may sit on the reader's own GPU (trainer and engine ranks colocated: the read is a
device-to-device copy inside that GPU, no staging) or on another one (a peer copy over NVLink/PCIe).
``endpoint_info`` carries one CUDA IPC handle per registered buffer (PyTorch's own reduction); ``connect`` opens
them in the reader's process once and enables peer access to their device there.

Spans are folded into 2-D copies (``kvmove.transport.copies``: a column block of a matrix is one copy, not one per
row); the reads of a batch from one source device become one copy plan, relative to a base tensor of this
endpoint, run by the executors ``kvmove.transport.executors`` assigns its copies to (the driver's copy engine; a Triton
kernel for narrow rows and many copies), because ``Tensor.copy_`` between devices waits on an event pair per copy
and cannot express a 2-D copy. A batch's plan and executor are built once (at ``prepare``: warm start) and reused
by later batches of the same prepared reads. Without libcuda the same plans run as torch strided-view copies.
``read`` runs on the reader's current stream and synchronizes before it returns; ``start_reads`` puts
each source device's reads on a stream of its own (a copy inside this GPU and a copy over the link proceed at
once) and leaves them in flight until waited for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from kvmove.transport.base import BufferDesc, EndpointInfo, Membership, ReadItem, Transport, TransportError
from kvmove.transport.copies import CopyPlan, copy_views, plan_copies, shifted
from kvmove.transport.cuda_driver import driver
from kvmove.transport.executors import CopyExecutor, executors

PLAN_CACHE = 8192
"""Copy plans kept per endpoint (a sync repeats the same reads every time)."""


class CudaIpcTransport(Transport):
    name = "cuda-ipc"
    devices = frozenset({"cuda"})
    strided = True
    maps_peers = True

    def __init__(self, device: str | None = None) -> None:
        if not torch.cuda.is_available():
            raise TransportError("the cuda-ipc transport needs a CUDA device")
        super().__init__()
        self.device = (
            torch.device(device) if device and ":" in device else torch.device("cuda", torch.cuda.current_device())
        )
        self._handles: dict[int, Any] = {}
        self._remote: dict[tuple[str, int], torch.Tensor] = {}
        self._peered: set[torch.device] = set()
        self._plans: dict[bytes, CopyPlan] = {}
        self._batches: dict[tuple[Any, ...], _Batch] = {}
        self._anchor: torch.Tensor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @classmethod
    def open(cls, membership: Membership | None = None, device: str = "cpu") -> CudaIpcTransport:
        return cls(device if device.startswith("cuda") else None)

    @classmethod
    def is_available(cls) -> bool:
        try:
            return bool(torch.cuda.is_available())
        except Exception:
            return False

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        if not buf.is_cuda:
            raise TransportError("the cuda-ipc transport moves CUDA buffers only")
        self._handles[buffer_id] = reduce_tensor(buf)

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(self.name, self.endpoint, dict(self._handles))

    def _connect(self, peer: EndpointInfo) -> None:
        for buffer_id, (rebuild, args) in peer.payload.items():
            remote = rebuild(*args)
            self._remote[(peer.endpoint, buffer_id)] = remote
            self._peer(remote)

    def _peer(self, src: torch.Tensor) -> None:
        """Enable peer access from this endpoint's device to ``src``'s, once per device.

        NOTE: a first ``copy_`` makes torch enable peer access between the two devices; without it the driver stages
        every copy through the host (measured: 36 GB/s instead of 390 on NVLink). It lands in a scratch byte.
        """
        if src.device not in self._peered:
            torch.empty(1, dtype=torch.uint8, device=self.device).copy_(src[:1])
            torch.cuda.synchronize(self.device)
            self._peered.add(src.device)

    def _source(self, remote: BufferDesc) -> torch.Tensor:
        src = self._remote.get((remote.endpoint, remote.buffer_id))
        if src is None:
            raise TransportError(f"buffer {remote.buffer_id} of {remote.endpoint} was not registered before connect")
        return src

    def _mapped(self, remote: BufferDesc) -> torch.Tensor:
        return self._source(remote)

    def _plan(self, spans: np.ndarray) -> CopyPlan:
        key = spans.tobytes()
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE:
                self._plans.clear()
            plan = self._plans[key] = plan_copies(spans)
        return plan

    def _batch(self, items: list[ReadItem]) -> _Batch:
        """The executor of ``items`` (reads from one source device) as one copy plan relative to this endpoint's
        base tensor. A batch of prepared reads (``Transport.prepare``: the same span arrays every sync) is built
        once and found again in any order; any other batch (fresh ranges each time) is built for this call only."""
        cached = all(self.is_prepared(i.spans) for i in items)
        key = tuple(sorted((id(i.spans), i.remote.endpoint, i.remote.buffer_id, i.local.data_ptr()) for i in items))
        hit = self._batches.get(key) if cached else None
        if hit is not None and {id(a) for a in hit.spans} == {id(i.spans) for i in items}:
            return hit  # NOTE: the batch holds its span arrays, so equal ids are the same arrays (in any order)
        for item in items:
            self._peer(self._source(item.remote))
        run: tuple[CopyExecutor, ...] = ()
        if driver() is not None:
            at = self._base().data_ptr()
            parts = [
                shifted(self._plan(i.spans), self._source(i.remote).data_ptr() - at, i.local.data_ptr() - at)
                for i in items
            ]
            plan = CopyPlan(np.concatenate([p.copies for p in parts]))
            peer = self._source(items[0].remote).device != self.device
            run = executors(plan, self._base(), peer, f"cuda-ipc read from {items[0].remote.endpoint}")
        batch = _Batch(tuple(i.spans for i in items), run, sum(int(i.spans[:, 2].sum()) for i in items))
        if cached:
            if len(self._batches) >= PLAN_CACHE:
                self._batches.clear()
            self._batches[key] = batch
        return batch

    def _base(self) -> torch.Tensor:
        if self._anchor is None:
            self._anchor = torch.zeros(16, dtype=torch.uint8, device=self.device)
        return self._anchor

    def _enqueue(self, items: list[ReadItem], stream: torch.cuda.Stream) -> None:
        batch = self._batch(items)
        if not batch.run:
            with torch.cuda.stream(stream):
                for item in items:
                    copy_views(self._source(item.remote), item.local, self._plan(item.spans))
            self._count("views", batch.nbytes)
            return
        torch.cuda.set_device(self.device)  # the reader's context is current for the driver calls
        for run in batch.run:
            run.run(stream)
            self._count(run.name, run.plan.nbytes)

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        stream = torch.cuda.current_stream(local.device)
        self._enqueue([ReadItem(peer, remote, local, spans)], stream)
        stream.synchronize()

    def _start(self, items: list[ReadItem]) -> Any:
        current = torch.cuda.current_stream(self.device)
        events = []
        for source, mine in _by_device(items, self._source).items():
            stream = self._stream(source)
            stream.wait_stream(current)  # NOTE: work queued before the batch (loads) lands first
            self._enqueue(mine, stream)
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)

        def finish() -> None:
            for event in events:
                event.synchronize()  # NOTE: releases the GIL: other threads (loads, serving) go on meanwhile

        return finish

    def _stream(self, source: torch.device) -> torch.cuda.Stream:
        if source not in self._streams:
            self._streams[source] = torch.cuda.Stream(self.device)
        return self._streams[source]

    def _prepare(self, items: list[ReadItem]) -> None:
        for source, mine in _by_device(items, self._source).items():
            self._stream(source)
            self._batch(mine)

    def _close(self) -> None:
        self._remote.clear()
        self._handles.clear()
        self._plans.clear()
        self._batches.clear()


class _Batch(NamedTuple):
    spans: tuple[np.ndarray, ...]
    """The span arrays of the batch's reads (a cached batch serves later reads of the very same arrays)."""
    run: tuple[CopyExecutor, ...]
    """Each executor with its share of the batch, in order; none without libcuda: torch strided-view copies."""
    nbytes: int


def _by_device(
    items: list[ReadItem], source: Callable[[BufferDesc], torch.Tensor]
) -> dict[torch.device, list[ReadItem]]:
    """The reads by the device of their source buffer, in order."""
    out: dict[torch.device, list[ReadItem]] = {}
    for item in items:
        out.setdefault(source(item.remote).device, []).append(item)
    return out
