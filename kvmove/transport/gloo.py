"""``gloo``: torch.distributed gloo send/recv, a pull emulated by a serving thread on every member.

Gloo is two-sided, so each endpoint runs a thread that answers read requests: the client sends a header
``(READ, buffer_id, n)`` and the ``(remote_offset, nbytes)`` spans, the server thread sends each span straight
out of its registered buffer and the client receives each straight into its own (no staging copies).
The process group is private to the transport (no global ``init_process_group``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from kvmove.ports import free_port
from kvmove.transport.base import BufferDesc, EndpointInfo, Membership, Transport, TransportError

_READ, _STOP = 1, 2
_TAG_HEADER, _TAG_SPANS, _TAG_STATUS, _TAG_DATA = 11, 12, 13, 14


@dataclass(frozen=True)
class GlooGroup:
    """Membership of one gloo transport group: this process's rank and a TCP store everyone can reach.

    Build it once (``GlooGroup.local(world_size)`` picks a free loopback port) and hand each member
    ``group.for_rank(r)``; rank 0 hosts the store. Every member must construct its transport concurrently.
    """

    rank: int
    world_size: int
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 120.0

    @classmethod
    def local(cls, world_size: int, host: str = "127.0.0.1") -> GlooGroup:
        return cls(0, world_size, host, free_port(host))

    def for_rank(self, rank: int) -> GlooGroup:
        return replace(self, rank=rank)


def is_gloo_available() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_gloo_available())
    except Exception:
        return False


class GlooTransport(Transport):
    """Endpoint ``group.rank`` of a gloo group; ``close()`` is collective: every member must call it."""

    name = "gloo"
    two_sided = True
    group_member = True
    rejoinable = False

    def __init__(self, *, group: GlooGroup):
        if not is_gloo_available():
            raise TransportError("this torch build has no torch.distributed gloo backend")
        super().__init__()
        self.group = group
        self._pg = _process_group(group)
        self._server = threading.Thread(target=self._serve, name=f"kvmove-gloo-{group.rank}", daemon=True)
        self._server.start()

    @classmethod
    def open(cls, membership: Membership | None = None, device: str = "cpu") -> GlooTransport:
        if membership is None:
            raise TransportError("the gloo transport needs its member id and the group's store (a Membership)")
        m = membership
        return cls(group=GlooGroup(m.member, m.world, m.host, m.port, m.timeout_s))

    @classmethod
    def is_available(cls) -> bool:
        return is_gloo_available()

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        if buf.device.type != "cpu":
            raise TransportError("the gloo transport moves CPU buffers only")

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(self.name, self.endpoint, self.group.rank)

    def _connect(self, peer: EndpointInfo) -> None:
        if not 0 <= peer.payload < self.group.world_size or peer.payload == self.group.rank:
            raise TransportError(f"gloo peer rank {peer.payload} is not another member of this group")

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        rank = int(peer.payload)
        header = torch.tensor([_READ, remote.buffer_id, len(spans)], dtype=torch.int64)
        self._pg.send([header], rank, _TAG_HEADER).wait()
        self._pg.send([torch.from_numpy(np.ascontiguousarray(spans[:, [0, 2]]))], rank, _TAG_SPANS).wait()
        status = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([status], rank, _TAG_STATUS).wait()
        if status.item() != 0:
            raise TransportError(f"buffer {remote.buffer_id} is not registered with endpoint {remote.endpoint}")
        works = [self._pg.recv([local[lo : lo + n]], rank, _TAG_DATA) for lo, n in spans[:, 1:].tolist()]
        for work in works:
            work.wait()

    def _serve(self) -> None:
        stops = 0
        header = torch.zeros(3, dtype=torch.int64)
        while stops < self.group.world_size - 1:
            work = self._pg.recv_anysource([header], _TAG_HEADER)
            work.wait()
            src = work._source_rank()
            op, buffer_id, count = header.tolist()
            if op == _STOP:
                stops += 1
                continue
            spans = torch.empty((count, 2), dtype=torch.int64)
            self._pg.recv([spans], src, _TAG_SPANS).wait()
            buf = self._buffers.get(buffer_id)  # NOTE: the client validated the ranges against our BufferDesc
            self._pg.send([torch.tensor([0 if buf is not None else 1])], src, _TAG_STATUS).wait()
            if buf is None:
                continue
            works = [self._pg.send([buf[ro : ro + n]], src, _TAG_DATA) for ro, n in spans.tolist()]
            for w in works:
                w.wait()

    def _close(self) -> None:
        stop = torch.tensor([_STOP, 0, 0], dtype=torch.int64)
        for rank in range(self.group.world_size):
            if rank != self.group.rank:
                self._pg.send([stop], rank, _TAG_HEADER).wait()
        self._server.join(timeout=self.group.timeout_s)


def _process_group(group: GlooGroup) -> Any:
    import torch.distributed as dist

    timeout = timedelta(seconds=group.timeout_s)
    store = dist.TCPStore(group.host, group.port, group.world_size, group.rank == 0, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=group.host)]
    return dist.ProcessGroupGloo(store, group.rank, group.world_size, options)
