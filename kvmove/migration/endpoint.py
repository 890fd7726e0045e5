"""A rank's host KV endpoint: the host pool, registered once with a transport, and one-sided pulls of pages.

Direction: the **target pulls** (one-sided NIXL READ from the source's registered host pool into its own). The
target computes every local byte range from the host pages it allocated for the migration, so a peer can never
make it write outside them; the source only names which of its own (staged) pages to read.
"""

from __future__ import annotations

import base64
import threading

import torch

from kvmove.kvcache import HostKVPool, KVGeometry
from kvmove.migration.errors import MigrationError, PeerUnreachableError
from kvmove.migration.messages import BufferInfo, SourceEndpoint
from kvmove.migration.session import geometry_info
from kvmove.transport import BufferDesc, EndpointInfo, TransferStats, Transport, TransportError, get_transport

SERVER_TRANSPORTS = ("nixl",)
"""Transports that work between two plain server processes without a shared process group."""


class HostEndpoint:
    """The host pool of one rank and its transport endpoint; thread-safe (one lock around the transport)."""

    def __init__(self, geometry: KVGeometry, num_pages: int, transport: str = "nixl") -> None:
        cls = get_transport(transport)
        if cls.name not in SERVER_TRANSPORTS:
            raise MigrationError(
                f"transport {cls.name!r} cannot move KV between server processes (use one of {SERVER_TRANSPORTS})"
            )
        self.pool = HostKVPool(geometry, num_pages)
        self.transport: Transport = cls()
        self._descs = [self.transport.register(_as_bytes(b)) for b in self.pool.buffers()]
        self._lock = threading.Lock()
        self._pool_lock = threading.Lock()

    def alloc(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` host pages, or None if the pool has fewer free."""
        with self._pool_lock:
            return self.pool.alloc(num_pages) if self.pool.can_alloc(num_pages) else None

    def free(self, pages: torch.Tensor) -> None:
        with self._pool_lock:
            self.pool.free(pages)

    @property
    def transport_name(self) -> str:
        return self.transport.name

    def describe(self, session_id: str, weight_version: str) -> SourceEndpoint:
        info = self.transport.endpoint_info()
        return SourceEndpoint(
            session_id=session_id,
            transport=info.transport,
            endpoint=info.endpoint,
            endpoint_info=base64.b64encode(bytes(info.payload)).decode(),
            buffers=[
                BufferInfo(endpoint=d.endpoint, buffer_id=d.buffer_id, nbytes=d.nbytes, address=d.address)
                for d in self._descs
            ],
            geometry=geometry_info(self.pool.geometry),
            weight_version=weight_version,
        )

    def pull(self, source: SourceEndpoint, src_pages: list[int], dst_pages: torch.Tensor) -> TransferStats:
        """Read ``src_pages`` of every source buffer into ``dst_pages`` (allocated here) of the matching buffer."""
        if source.transport != self.transport.name:
            raise MigrationError(f"source uses transport {source.transport!r}, this rank {self.transport.name!r}")
        if len(source.buffers) != len(self._descs) or len(src_pages) != dst_pages.numel():
            raise MigrationError(f"{len(src_pages)} source pages for {dst_pages.numel()} target pages")
        item = self.pool.item_lens()[0]
        ranges = [(s * item, int(d) * item, item) for s, d in zip(src_pages, dst_pages.tolist(), strict=True)]
        total, seconds = 0, 0.0
        with self._lock:
            try:
                self.transport.connect(_endpoint_info(source))
                for remote, local in zip(source.buffers, self._descs, strict=True):
                    stats = self.transport.read(_remote_desc(source.transport, remote), local, ranges)
                    total, seconds = total + stats.bytes, seconds + stats.seconds
            except TransportError as exc:
                raise PeerUnreachableError(f"pull from {source.session_id} failed: {exc}") from exc
        return TransferStats(total, seconds)

    def close(self) -> None:
        with self._lock:
            self.transport.close()


def _as_bytes(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(-1).view(torch.uint8)


def _endpoint_info(source: SourceEndpoint) -> EndpointInfo:
    try:
        payload = base64.b64decode(source.endpoint_info, validate=True)
    except ValueError as exc:
        raise MigrationError(f"source endpoint_info is not valid: {exc}") from exc
    return EndpointInfo(source.transport, source.endpoint, payload)


def _remote_desc(transport: str, b: BufferInfo) -> BufferDesc:
    return BufferDesc(transport, b.endpoint, b.buffer_id, b.nbytes, b.address)
