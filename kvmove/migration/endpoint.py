"""A rank's host KV endpoint: the host pool, registered once with a transport, and one-sided pulls of pages.

Direction: the **target pulls** from the source's registered host pool into its own: a one-sided NIXL READ, or,
where NIXL is absent, an HTTP read answered by the source's server (``http``, a slower fallback). The target
computes every local byte range from the host pages it allocated for the migration, so a peer can never make it
write outside them; the source only names which of its own (staged) pages to read. Over ``http`` the source also
lets the target read only those pages, only until the transfer returns (``offer``/``withdraw``); NIXL cannot
restrict a one-sided READ, so there a peer holding the agent metadata may read the whole registered pool.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.kvcache import HeadSlice, HostKVPool, KVGeometry
from kvmove.kvcache.host_link import HostLink
from kvmove.migration.errors import MigrationError, PeerUnreachableError
from kvmove.migration.messages import BufferInfo, SourceEndpoint
from kvmove.migration.session import check_transport, geometry_info
from kvmove.transport import (
    TRANSPORTS,
    BufferDesc,
    EndpointInfo,
    HttpTransport,
    NixlTransport,
    TransferStats,
    Transport,
    TransportError,
)
from kvmove.transport.http_route import ReadAnswer, ReadRefused
from kvmove.transport.local import LocalTransport

SERVER_TRANSPORTS: dict[str, Callable[[str], Transport]] = {
    "nixl": lambda url: NixlTransport(),
    "http": lambda url: HttpTransport(url=url or None),
}
"""Transports that move KV between two plain server processes, in the order ``auto`` tries them, each built from
the base URL of the server it lives in (the ``http`` one serves its reads through that server's routes)."""

IN_PROCESS_TRANSPORTS: dict[str, Callable[[str], Transport]] = {"local": lambda url: LocalTransport()}
"""Transports between endpoints of one process only (both sides of a benchmark); only ever chosen by name."""

FALLBACK_NOTE = "NIXL is not installed (pip install 'kvmove[nixl]'); KV pages move over HTTP, a slower fallback"


class TransportChoice(NamedTuple):
    """The data plane a server uses: ``name``, what was ``requested``, and ``note`` saying why auto fell back."""

    name: str
    requested: str
    note: str = ""

    @property
    def fallback(self) -> bool:
        return bool(self.note)


def choose_transport(requested: str) -> TransportChoice:
    """``auto``: nixl where it imports, else http (noted: ``FALLBACK_NOTE``); ``nixl`` or ``http`` as asked.

    An unknown name, or a named transport that is not installed, is a KvmoveError naming what to do.
    """
    if requested == "auto":
        name = next((n for n in SERVER_TRANSPORTS if TRANSPORTS[n].is_available()), None)
        if name is None:
            raise MissingDependencyError("no KV transport is installed here: pip install 'kvmove[serve]'")
        return TransportChoice(name, requested, "" if name == "nixl" else FALLBACK_NOTE)
    if requested in IN_PROCESS_TRANSPORTS:
        return TransportChoice(requested, requested)
    if requested not in SERVER_TRANSPORTS:
        known = ", ".join(["auto", *SERVER_TRANSPORTS])
        raise KvmoveError(f"transport {requested!r} cannot move KV between servers (use one of: {known})")
    if not TRANSPORTS[requested].is_available():
        hint = f"pip install 'kvmove[{TRANSPORTS[requested].extra}]'"
        hint += " (or --transport http, a slower fallback)" if requested == "nixl" else ""
        raise MissingDependencyError(f"transport {requested!r} is not installed here: {hint}")
    return TransportChoice(requested, requested)


class HostEndpoint:
    """The host pool of one rank and its transport endpoint (``link``); thread-safe (one lock around the
    transport's reads, another around the pool's page table, neither ever held by the decode loop).

    ``transport``: auto, nixl or http (``choose_transport``), or ``local`` (within one process); ``url``: the base
    URL of this rank's server. ``pin_memory``: page-locked host buffers (fast copies to and from a GPU).
    """

    def __init__(
        self, geometry: KVGeometry, num_pages: int, transport: str = "auto", url: str = "", pin_memory: bool = False
    ) -> None:
        self.choice = choose_transport(transport)
        self.pool = HostKVPool(geometry, num_pages, pin_memory=pin_memory)
        factory = IN_PROCESS_TRANSPORTS.get(self.choice.name) or SERVER_TRANSPORTS[self.choice.name]
        self.transport: Transport = factory(url)
        self.link = HostLink(self.pool, self.transport)
        self._descs = self.link.descs
        self._pool_lock = threading.Lock()
        self.staged_pages = 0

    def alloc(self, num_pages: int, staged: bool = False) -> torch.Tensor | None:
        """``num_pages`` host pages, or None if the pool has fewer free. ``staged``: a source's pages for one
        transfer (counted in ``staged_pages`` until freed with ``staged=True``)."""
        with self._pool_lock:
            if not self.pool.can_alloc(num_pages):
                return None
            self.staged_pages += num_pages if staged else 0
            return self.pool.alloc(num_pages)

    def free(self, pages: torch.Tensor, staged: bool = False) -> None:
        with self._pool_lock:
            self.pool.free(pages)
            self.staged_pages -= pages.numel() if staged else 0

    def check_owned(self, migration_pages: int) -> None:
        """Pool invariants, and every used page owned: by migrations (``migration_pages``, counted by the caller
        under its own lock) or staged by a transfer; no read grant without staged pages."""
        with self._pool_lock:
            self.pool.check_integrity()
            used, owned = self.pool.used_pages, migration_pages + self.staged_pages
            if used != owned:
                raise MigrationError(
                    f"host pool: {used} pages used != {migration_pages} of migrations + {self.staged_pages} staged"
                )
            if self.open_grants and not self.staged_pages:
                raise MigrationError(f"{self.open_grants} read grants outlived their transfers")

    @property
    def transport_name(self) -> str:
        return self.transport.name

    @property
    def open_grants(self) -> int:
        """Reads this rank currently lets a peer make (``http``; always 0 for NIXL, which cannot restrict them)."""
        return self.transport.open_grants if isinstance(self.transport, HttpTransport) else 0

    def offer(self, session_id: str, weight_version: str, pages: torch.Tensor) -> SourceEndpoint:
        """This rank's endpoint as the target of one transfer sees it: over ``http`` it may read ``pages`` of
        every host buffer and nothing else, until ``withdraw``."""
        if isinstance(self.transport, HttpTransport):
            item = self.pool.item_lens()[0]
            spans = [(p * item, item) for p in pages.tolist()]
            info = self.transport.grant({d.buffer_id: spans for d in self._descs})
        else:
            info = self.transport.endpoint_info()  # NOTE: a NIXL peer can READ any registered byte regardless
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

    def withdraw(self, offer: SourceEndpoint) -> None:
        """End what ``offer`` allowed: from now on the target's reads of those pages are refused."""
        if isinstance(self.transport, HttpTransport):
            self.transport.revoke(_endpoint_info(offer))

    def serve(self, body: bytes) -> ReadAnswer:
        """A peer's HTTP read of pages this rank offered it (``http`` only; ReadRefused with the status otherwise).

        NOTE: never takes the link's read lock: two servers pulling from each other at once would deadlock.
        """
        if not isinstance(self.transport, HttpTransport):
            raise ReadRefused(404, f"this rank moves KV over {self.transport.name}; HTTP reads serve only http")
        return self.transport.serve(body)

    def pull(
        self,
        source: SourceEndpoint,
        src_pages: list[int],
        dst_pages: torch.Tensor,
        src_geometry: KVGeometry | None = None,
        pieces: Sequence[HeadSlice] = (),
    ) -> TransferStats:
        """Read ``src_pages`` of every source buffer into ``dst_pages`` (allocated here) of the matching buffer:
        whole pages, or (a source rank of ``src_geometry`` splitting the heads differently) only the heads of
        ``pieces``, each token's heads one contiguous range."""
        check_transport(self.transport.name, source.transport)
        if len(source.buffers) != len(self._descs) or len(src_pages) != dst_pages.numel():
            raise MigrationError(f"{len(src_pages)} source pages for {dst_pages.numel()} target pages")
        remote = [_remote_desc(source.transport, b) for b in source.buffers]
        try:
            return self.link.read(_endpoint_info(source), remote, src_pages, dst_pages.tolist(), src_geometry, pieces)
        except TransportError as exc:
            raise PeerUnreachableError(f"pull from {source.session_id} failed: {exc}") from exc

    def close(self) -> None:
        self.link.close()


def _endpoint_info(source: SourceEndpoint) -> EndpointInfo:
    try:
        payload = base64.b64decode(source.endpoint_info, validate=True)
    except ValueError as exc:
        raise MigrationError(f"source endpoint_info is not valid: {exc}") from exc
    return EndpointInfo(source.transport, source.endpoint, payload)


def _remote_desc(transport: str, b: BufferInfo) -> BufferDesc:
    return BufferDesc(transport, b.endpoint, b.buffer_id, b.nbytes, b.address)
