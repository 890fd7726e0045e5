"""A rank's host KV endpoint: its inbox and outbox host pools, a transport, and one-sided pulls of pages.

Direction: the **target pulls** from the source's outbox into its own inbox: a one-sided NIXL READ, or, where
NIXL is absent, an HTTP read answered by the source's server (``http``, a slower fallback). The target computes
every local byte range from the inbox pages it allocated for the migration, so a peer can never make it write
outside them; the source only names which of its own staged pages to read.

What a peer can reach: the inbox is registered for local use only and never offered to anyone. The outbox holds
pages only while a transfer stages them: ``offer`` lets exactly the target of one transfer read exactly those
pages (over NIXL: registered for that transfer and published as partial agent metadata; over HTTP: a read grant
for those spans), ``withdraw`` ends it (deregistered, grant revoked) and ``unstage`` scrubs the pages before they
are freed, so a late READ fails where the transport enforces registrations and finds zeros where it does not (UCX
over tcp or shared memory). Session infos carry opaque buffer handles (``handles``), never process addresses; an
offer names its buffers' addresses only over NIXL, whose READs need them (to the one authenticated target).
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.kvcache import HeadSlice, HostKVPool, KVGeometry
from kvmove.kvcache.host_link import HostLink
from kvmove.migration.errors import MigrationError, PeerUnreachableError
from kvmove.migration.messages import BufferInfo, SourceEndpoint
from kvmove.migration.peers import PeerAddress, PeerRefusedError
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
from kvmove.transport.interfaces import interface_of
from kvmove.transport.local import LocalTransport

HANDLE_STRIDE = 1 << 40
"""Opaque ``host_kv_data_ptrs``: buffer ``i`` is published as ``i * HANDLE_STRIDE``, never a process address."""


class TransportSetup(NamedTuple):
    """How a server's transport is built: ``url`` of the server it lives in, ``headers`` its reads send (the peer
    key), ``host`` the server binds (NIXL then listens on that interface only; "" for all)."""

    url: str = ""
    headers: Mapping[str, str] = {}
    host: str = ""


SERVER_TRANSPORTS: dict[str, Callable[[TransportSetup], Transport]] = {
    "nixl": lambda s: NixlTransport(net_device=interface_of(s.host) if s.host else None),
    "http": lambda s: HttpTransport(url=s.url or None, headers=s.headers),
}
"""Transports that move KV between two plain server processes, in the order ``auto`` tries them (the ``http`` one
serves its reads through the routes of the server it lives in)."""

ADDRESSED_TRANSPORTS = frozenset({"nixl"})
"""Transports whose reads name the peer buffer's address (a NIXL READ); every other one names buffers by id only."""

IN_PROCESS_TRANSPORTS: dict[str, Callable[[TransportSetup], Transport]] = {"local": lambda s: LocalTransport()}
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
    """The inbox and outbox host pools of one rank and its transport endpoint (``link``); thread-safe (one lock
    around the transport's reads, another around the pools' page tables and the transport's grants, neither ever
    held by the decode loop).

    ``transport``: auto, nixl or http (``choose_transport``), or ``local`` (within one process); ``setup``: how to
    build it. ``outbox_pages``: 0 for as many as the inbox. ``pin_memory``: page-locked host buffers.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        transport: str = "auto",
        setup: TransportSetup = TransportSetup(),
        pin_memory: bool = False,
        outbox_pages: int = 0,
    ) -> None:
        self.choice = choose_transport(transport)
        self.pool = HostKVPool(geometry, num_pages, pin_memory=pin_memory)
        self.outbox = HostKVPool(geometry, outbox_pages or num_pages, pin_memory=pin_memory)
        factory = IN_PROCESS_TRANSPORTS.get(self.choice.name) or SERVER_TRANSPORTS[self.choice.name]
        self.transport: Transport = factory(setup)
        self.link = HostLink(self.pool, self.transport)
        self._descs = self.link.descs
        self._out_descs = [self.transport.register(b.view(-1).view(torch.uint8)) for b in self.outbox.buffers()]
        self._pool_lock = threading.Lock()

    def alloc(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` inbox pages (a target's, for one migration), or None if the inbox has fewer free."""
        with self._pool_lock:
            return self.pool.alloc(num_pages) if self.pool.can_alloc(num_pages) else None

    def free(self, pages: torch.Tensor) -> None:
        with self._pool_lock:
            self.pool.free(pages)

    def stage(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` outbox pages to stage one transfer in, or None if the outbox has fewer free."""
        with self._pool_lock:
            return self.outbox.alloc(num_pages) if self.outbox.can_alloc(num_pages) else None

    def unstage(self, pages: torch.Tensor) -> None:
        """Scrub and free outbox ``pages`` (withdraw their offer first)."""
        with self._pool_lock:
            self.outbox.scrub(pages)
            self.outbox.free(pages)

    @property
    def staged_pages(self) -> int:
        return self.outbox.used_pages

    def check_owned(self, migration_pages: int) -> None:
        """Pool invariants, every inbox page owned by a migration (``migration_pages``, counted by the caller under
        its own lock), and no offer open without staged pages."""
        with self._pool_lock:
            self.pool.check_integrity()
            self.outbox.check_integrity()
            used = self.pool.used_pages
            if used != migration_pages:
                raise MigrationError(f"host pool: {used} pages used != {migration_pages} of migrations")
            if self.open_grants and not self.staged_pages:
                raise MigrationError(f"{self.open_grants} read grants outlived their transfers")

    @property
    def transport_name(self) -> str:
        return self.transport.name

    @property
    def open_grants(self) -> int:
        """Offers not yet withdrawn (transfers whose target may read now)."""
        grants = getattr(self.transport, "open_grants", 0)
        return grants if isinstance(grants, int) else 0

    def handles(self) -> list[int]:
        """Opaque ``host_kv_data_ptrs`` of the inbox buffers (``HANDLE_STRIDE`` apart, never addresses)."""
        return [i * HANDLE_STRIDE for i in range(len(self._descs))]

    def offer(self, session_id: str, weight_version: str, pages: torch.Tensor) -> SourceEndpoint:
        """What the target of one transfer needs to read outbox ``pages`` of every buffer (and nothing else), until
        ``withdraw``. (The in-process ``local`` transport cannot restrict reads: it never leaves the process.)"""
        item = self.outbox.item_lens()[0]
        spans = [(p * item, item) for p in pages.tolist()]
        with self._pool_lock:
            if isinstance(self.transport, HttpTransport | NixlTransport):
                info = self.transport.grant({d.buffer_id: spans for d in self._out_descs})
            else:
                info = self.transport.endpoint_info()
        return SourceEndpoint(
            session_id=session_id,
            transport=info.transport,
            endpoint=info.endpoint,
            endpoint_info=base64.b64encode(bytes(info.payload or b"")).decode(),
            buffers=[
                BufferInfo(endpoint=d.endpoint, buffer_id=d.buffer_id, nbytes=d.nbytes, address=self._address(d))
                for d in self._out_descs
            ],
            geometry=geometry_info(self.pool.geometry),
            weight_version=weight_version,
        )

    def _address(self, desc: BufferDesc) -> int | None:
        """What a buffer's offer says of its address: the address where the transport reads by address (NIXL, to
        the authenticated target it grants), nothing elsewhere (http reads name the buffer id)."""
        return desc.address if self.transport.name in ADDRESSED_TRANSPORTS else None

    def withdraw(self, offer: SourceEndpoint) -> None:
        """End what ``offer`` allowed: from now on the target's reads of those pages are refused."""
        with self._pool_lock:
            if isinstance(self.transport, HttpTransport | NixlTransport):
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
        info = _endpoint_info(source)
        _check_reads_from(info, source.session_id)
        remote = [_remote_desc(source.transport, b) for b in source.buffers]
        try:
            return self.link.read(info, remote, src_pages, dst_pages.tolist(), src_geometry, pieces)
        except TransportError as exc:
            raise PeerUnreachableError(f"pull from {source.session_id} failed: {exc}") from exc

    def close(self) -> None:
        self.link.close()


def _check_reads_from(info: EndpointInfo, session_id: str) -> None:
    """Over http the reads go to the URL in the source's info: it must be the source's own server."""
    if info.transport != "http":
        return
    source = PeerAddress.parse(session_id)
    try:
        url = HttpTransport.url_of(info)
    except TransportError as exc:
        raise MigrationError(str(exc)) from exc
    if not url.startswith("http://") or PeerAddress.parse(url.removeprefix("http://").rstrip("/")) != source:
        raise PeerRefusedError(f"the source's data plane URL {url[:80]!r} is not its session {source.session_id}")


def _endpoint_info(source: SourceEndpoint) -> EndpointInfo:
    try:
        payload = base64.b64decode(source.endpoint_info, validate=True)
    except ValueError as exc:
        raise MigrationError(f"source endpoint_info is not valid: {exc}") from exc
    return EndpointInfo(source.transport, source.endpoint, payload)


def _remote_desc(transport: str, b: BufferInfo) -> BufferDesc:
    if transport in ADDRESSED_TRANSPORTS and b.address is None:
        raise MigrationError(f"source buffer {b.endpoint}#{b.buffer_id} has no address, which {transport} reads by")
    return BufferDesc(transport, b.endpoint, b.buffer_id, b.nbytes, b.address or 0)
