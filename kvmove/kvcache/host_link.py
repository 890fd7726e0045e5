"""A host KV pool registered with a transport: what a peer reads from, and the reads of a peer's pages into it.

The data plane of a migration without its protocol (no HTTP, no messages): ``descs`` are this pool's layer buffers
as a peer reads them (registered once); ``read`` pulls pages of a peer's pool into pages of this one, whole, or
only the KV heads this rank holds when the peer splits them differently (``kvmove.kvcache.heads``). The migration
target (``kvmove.migration.endpoint``) and the GPU resume benchmark both move pages through it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache.geometry import KVGeometry
from kvmove.kvcache.heads import HeadSlice, slice_ranges
from kvmove.kvcache.host_pool import HostKVPool
from kvmove.transport.base import BufferDesc, EndpointInfo, TransferStats, Transport

_NEVER = object()  # a peer never connected


class HostLink:
    """Thread-safe: one lock around the transport's reads (an endpoint is used from one thread at a time), never
    held by anything but reads."""

    def __init__(self, pool: HostKVPool, transport: Transport) -> None:
        self.pool, self.transport = pool, transport
        self.descs = [transport.register(b.view(-1).view(torch.uint8)) for b in pool.buffers()]
        self._lock = threading.Lock()
        self._peers: dict[str, object] = {}  # peer endpoint -> the info it was connected with

    def read(
        self,
        peer: EndpointInfo,
        remote: Sequence[BufferDesc],
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        src_geometry: KVGeometry | None = None,
        pieces: Sequence[HeadSlice] = (),
    ) -> TransferStats:
        """Read ``src_pages`` of every ``remote`` buffer (the peer's K then V layer buffers) into ``dst_pages`` of
        the matching buffer here: whole pages, or (a peer of ``src_geometry``) only the heads of ``pieces``."""
        if len(remote) != len(self.descs) or len(src_pages) != len(dst_pages):
            raise KVCacheError(
                f"{len(src_pages)} source pages of {len(remote)} buffers for {len(dst_pages)} target pages of "
                f"{len(self.descs)} buffers"
            )
        mine = self.pool.geometry
        if src_geometry is None or not pieces:
            src_geometry, pieces = mine, [HeadSlice(0, 0, 0, mine.num_kv_heads)]
        ranges = np.concatenate([slice_ranges(src_geometry, mine, src_pages, dst_pages, p) for p in pieces])
        total, seconds = 0, 0.0
        with self._lock:
            self._connect(peer)
            for theirs, ours in zip(remote, self.descs, strict=True):
                stats = self.transport.read(theirs, ours, ranges)
                total, seconds = total + stats.bytes, seconds + stats.seconds
        return TransferStats(total, seconds)

    def close(self) -> None:
        with self._lock:
            self.transport.close()

    def _connect(self, peer: EndpointInfo) -> None:
        """Connect unless connected with this very info already (NIXL wire-up costs tens of ms; a peer's info
        changes when it registers memory or, over http, with every transfer's grant)."""
        if self._peers.get(peer.endpoint, _NEVER) != peer.payload:
            self.transport.connect(peer)
            self._peers[peer.endpoint] = peer.payload
