"""NCCL point-to-point: pulls emulated over send/recv, one communicator per (reader, server) direction.

NCCL is two-sided: the server runs one serving thread per connected reader, which receives a request
(buffer id and spans) and sends the spans back. Each direction has its own two-member communicator, so no
communicator is ever used by two threads. ``backend="gloo"`` runs the same protocol on CPU (for tests).
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

from kvmove.transport.base import BufferDesc, EndpointInfo, Transport, TransportError

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

    @classmethod
    def is_available(cls) -> bool:
        try:
            import torch.distributed as dist

            return bool(torch.cuda.is_available() and dist.is_nccl_available())
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

    def _small(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

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
        if (self.group.member, other) not in self._pairs:
            self._store.set(f"reader-{self.group.member}-{other}", "1")
        pg = self._pair(self.group.member, other)
        if other not in self._reader_streams and self.backend == "nccl":
            self._reader_streams[other] = torch.cuda.Stream(self.device)
        with self._stream(self._reader_streams.get(other)):
            self._pull(pg, remote, local, spans)

    def _pull(self, pg: Any, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        pg.send([self._small([_READ, remote.buffer_id, len(spans)])], 1, 0).wait()
        pg.send([torch.from_numpy(np.ascontiguousarray(spans[:, [0, 2]])).to(self.device)], 1, 1).wait()
        status = self._small([0])
        pg.recv([status], 1, 2).wait()
        if int(status.item()) != 0:
            raise TransportError(f"buffer {remote.buffer_id} is not registered with endpoint {remote.endpoint}")
        for lo, n in spans[:, 1:].tolist():
            pg.recv([local[lo : lo + n]], 1, 3).wait()
        if local.is_cuda:
            torch.cuda.current_stream(local.device).synchronize()

    def _serve(self, reader: int) -> None:
        key = f"reader-{reader}-{self.group.member}"
        while not self._store.check([key]):
            if self._closed:
                return
            time.sleep(0.02)
        with self._stream():
            self._answer(reader, self._pair(reader, self.group.member))

    def _answer(self, reader: int, pg: Any) -> None:
        header = self._small([0, 0, 0])
        while True:
            pg.recv([header], 0, 0).wait()
            op, buffer_id, count = (int(x) for x in header.tolist())
            if op == _STOP:
                return
            spans = torch.empty((count, 2), dtype=torch.int64, device=self.device)
            pg.recv([spans], 0, 1).wait()
            buf = self._buffers.get(buffer_id)
            pg.send([self._small([0 if buf is not None else 1])], 0, 2).wait()
            if buf is None:
                continue
            for ro, n in spans.tolist():
                pg.send([buf[ro : ro + n]], 0, 3).wait()
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()

    def _close(self) -> None:
        for (reader, _server), pg in list(self._pairs.items()):
            if reader == self.group.member:  # stop the peer's thread that serves our reads
                pg.send([self._small([_STOP, 0, 0])], 1, 0).wait()
