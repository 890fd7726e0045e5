"""NCCL point-to-point: pulls emulated over send/recv, one communicator per (reader, server) direction.

NCCL is two-sided: the server runs one serving thread per connected reader. A read is a request (buffer id
and spans) posted in the group's TCP store, an acknowledgement there (the server checked the buffer and the
bounds), then the spans as NCCL sends matched by the reader's receives. Requests travel over the store, not
NCCL, on purpose: an NCCL receive posted while waiting for the next request would sit on the GPU for as long
as the wait lasts, and any implicitly device-synchronizing call of that process (a ``cudaFree`` by the caching
allocator, say) would then never return. Each direction has its own two-member communicator and each thread
its own CUDA stream. ``backend="gloo"`` runs the same protocol on CPU (for tests).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from kvmove.transport.base import BufferDesc, EndpointInfo, Membership, Transport, TransportError

_READ, _STOP = 1, 2


@dataclass(frozen=True)
class NcclGroup:
    """A TCP store every member reaches (member 0 hosts it); ``member`` is this process's id."""

    member: int
    world_size: int
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 120.0


class NcclTransport(Transport):
    name = "nccl"
    devices = frozenset({"cpu", "cuda"})
    two_sided = True
    group_member = True
    rejoinable = False
    shares_devices = False

    def __init__(self, *, group: NcclGroup, device: str = "cuda", backend: str = "nccl") -> None:
        import torch.distributed as dist

        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise TransportError("the nccl transport needs CUDA and a torch built with NCCL")
        super().__init__()
        self.group, self.device, self.backend = group, torch.device(device), backend
        timeout = timedelta(seconds=group.timeout_s)
        self._dist = dist
        self._store = dist.TCPStore(
            group.host, group.port, group.world_size, group.member == 0, timeout=timeout, wait_for_workers=False
        )
        self._pairs: dict[tuple[int, int], Any] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._reader_streams: dict[int, Any] = {}
        self._seq: dict[int, int] = {}

    @classmethod
    def open(cls, membership: Membership | None = None, device: str = "cpu") -> NcclTransport:
        """NCCL for CUDA buffers; on CPU the same pull protocol over gloo (the CPU twin of the GPU path)."""
        if membership is None:
            raise TransportError("the nccl transport needs its member id and the group's store (a Membership)")
        m = membership
        group = NcclGroup(m.member, m.world, m.host, m.port, m.timeout_s)
        return cls(group=group, device=device, backend="nccl" if device.startswith("cuda") else "gloo")

    @classmethod
    def is_available(cls) -> bool:
        """NCCL for CUDA buffers, or its gloo twin for CPU ones: torch.distributed is all it needs."""
        try:
            import torch.distributed as dist

            return bool(dist.is_available())
        except Exception:
            return False

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        if (buf.device.type == "cuda") != (self.backend == "nccl"):
            raise TransportError(f"the {self.backend} protocol cannot move a {buf.device.type} buffer")

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(self.name, self.endpoint, self.group.member)

    def _pair(self, reader: int, server: int) -> Any:
        """The communicator of ``reader`` pulling from ``server`` (reader is member 0 in it)."""
        key = (reader, server)
        with self._lock:
            if key not in self._pairs:
                dist = self._dist
                prefix = dist.PrefixStore(f"pull-{reader}-{server}", self._store)
                me = 0 if self.group.member == reader else 1
                if self.backend == "nccl":
                    options = dist.ProcessGroupNCCL.Options()
                    options._timeout = timedelta(seconds=self.group.timeout_s)
                    self._pairs[key] = dist.ProcessGroupNCCL(prefix, me, 2, options)
                else:
                    opts = dist.ProcessGroupGloo._Options()
                    opts._timeout = timedelta(seconds=self.group.timeout_s)
                    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.group.host)]
                    self._pairs[key] = dist.ProcessGroupGloo(prefix, me, 2, opts)
            return self._pairs[key]

    def _connect(self, peer: EndpointInfo) -> None:
        """Both sides call connect: we may read from ``peer`` and serve its reads of our buffers.

        A direction's communicator is only built once its reader announces its first read in the store, so a
        direction nobody reads never starts an NCCL init (which would block other inits of this process).
        """
        other = int(peer.payload)
        if other == self.group.member or not 0 <= other < self.group.world_size:
            raise TransportError(f"nccl peer {other} is not another member of this group")
        thread = threading.Thread(target=self._serve, args=(other,), daemon=True, name=f"kvmove-nccl-{other}")
        thread.start()
        self._threads.append(thread)

    def _stream(self, stream: Any = None) -> contextlib.AbstractContextManager[Any]:
        """A private CUDA stream for the calling thread's NCCL work.

        NOTE: ``work.wait()`` makes the *current* stream wait for the NCCL stream. On the shared default stream
        a serving thread's posted receive (waiting for the next request, possibly a whole sync away) would
        stall every later kernel of the process, packs and gathers included: each thread gets its own stream.
        """
        if self.backend != "nccl":
            return contextlib.nullcontext()
        return torch.cuda.stream(stream or torch.cuda.Stream(self.device))

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        other = int(peer.payload)
        key = f"pull/{self.group.member}/{other}"
        if (self.group.member, other) not in self._pairs:
            self._store.set(f"reader-{self.group.member}-{other}", "1")
        pg = self._pair(self.group.member, other)
        seq = self._seq[other] = self._seq.get(other, 0) + 1
        request = np.concatenate(([_READ, remote.buffer_id, len(spans)], spans[:, [0, 2]].ravel())).astype(np.int64)
        self._store.set(f"{key}/req/{seq}", request.tobytes())  # type: ignore[arg-type]  # bytes are fine
        status = self._store.get(f"{key}/ack/{seq}").decode()
        self._store.delete_key(f"{key}/ack/{seq}")
        if status:
            raise TransportError(status)
        if self.backend == "nccl" and other not in self._reader_streams:
            self._reader_streams[other] = torch.cuda.Stream(self.device)
        with self._stream(self._reader_streams.get(other)):
            works = [pg.recv([local[lo : lo + n]], 1, 0) for lo, n in spans[:, 1:].tolist()]
            for w in works:
                w.wait()
            if local.is_cuda:
                torch.cuda.current_stream(local.device).synchronize()

    def _client(self) -> Any:
        """A store connection of the calling thread's own.

        NOTE: a store client serializes its calls, and a serving thread spends its time in blocking waits: on a
        shared client every other thread's request, acknowledgement or announcement would queue behind them.
        """
        g = self.group
        timeout = timedelta(seconds=g.timeout_s)
        return self._dist.TCPStore(g.host, g.port, g.world_size, False, timeout=timeout, wait_for_workers=False)

    def _serve(self, reader: int) -> None:
        store = self._client()
        key = f"reader-{reader}-{self.group.member}"
        while not store.check([key]):
            if self._closed:
                return
            time.sleep(0.02)
        with self._stream():
            self._answer(reader, self._pair(reader, self.group.member), store)

    def _answer(self, reader: int, pg: Any, store: Any) -> None:
        key, seq = f"pull/{reader}/{self.group.member}", 0
        while True:
            seq += 1
            request = self._next_request(store, f"{key}/req/{seq}")
            if request is None:
                return
            op, buffer_id, count = (int(x) for x in request[:3])
            if op == _STOP:
                return
            spans = request[3:].reshape(count, 2)
            buf = self._buffers.get(buffer_id)
            status = "" if buf is not None else f"buffer {buffer_id} is not registered with endpoint {self.endpoint}"
            if buf is not None and len(spans) and int((spans[:, 0] + spans[:, 1]).max()) > buf.numel():
                status = f"a span ends past the {buf.numel()}-byte buffer {buffer_id} of {self.endpoint}"
            store.set(f"{key}/ack/{seq}", status)
            if status or buf is None:
                continue
            works = [pg.send([buf[ro : ro + n]], 0, 0) for ro, n in spans.tolist()]
            for w in works:
                w.wait()
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()

    def _next_request(self, store: Any, key: str) -> np.ndarray | None:
        """The request posted under ``key`` (waits for it; None once this endpoint is closed)."""
        while True:
            try:
                store.wait([key], timedelta(seconds=1))
                break
            except Exception:  # the store's timeout: look whether we were closed, then wait on
                if self._closed:
                    return None
        request = np.frombuffer(store.get(key), dtype=np.int64)
        store.delete_key(key)
        return request

    def _close(self) -> None:
        for reader, server in list(self._pairs):
            if reader == self.group.member:  # stop the peer's thread that serves our reads
                seq = self._seq[server] = self._seq.get(server, 0) + 1
                stop = np.array([_STOP, 0, 0], np.int64).tobytes()
                self._store.set(f"pull/{reader}/{server}/req/{seq}", stop)  # type: ignore[arg-type]
