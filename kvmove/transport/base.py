"""The transport interface: one endpoint per process, buffers registered once, one-sided pulls of byte ranges.

A *server* endpoint registers the uint8 buffers ("slots") it packs bytes into and publishes its
``endpoint_info()``; a *client* endpoint registers its own uint8 receive buffers, ``connect``s to the
server's info once and then ``read``s many ``(remote_offset, local_offset, nbytes)`` ranges in one call.
Buffers are registered once, at init, and reused by every read.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from kvmove.errors import KvmoveError

MAX_CHECKED = 65536
"""Prepared reads whose checked spans an endpoint keeps (a sync plan's direct reads: a few hundred per rank)."""

Range = tuple[int, int, int]
"""``(remote_offset, local_offset, nbytes)`` of one pulled span, in bytes."""


class TransportError(KvmoveError):
    """A transport used wrongly (unregistered buffer, range out of bounds, unknown peer) or a failed transfer."""


class TransferStats(NamedTuple):
    """What one ``read`` moved and how long it took (wall clock, in the calling process)."""

    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class BufferDesc:
    """A picklable handle to a registered buffer; ``endpoint`` names the endpoint that registered it."""

    transport: str
    endpoint: str
    buffer_id: int
    nbytes: int
    address: int = 0
    device: str = "cpu"
    device_id: int = 0


class Membership(NamedTuple):
    """This endpoint's place in a run's fixed group of endpoints (transports with ``group_member``): its member
    id, the group size and a TCP store every member reaches (member 0 hosts it)."""

    member: int
    world: int
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 120.0


@dataclass(frozen=True)
class EndpointInfo:
    """All a peer needs to ``connect``: ``payload`` is transport-specific (NIXL agent metadata, actor handle, rank)."""

    transport: str
    endpoint: str
    payload: Any = None


class ReadItem(NamedTuple):
    """A checked read: the peer, the remote buffer, the local tensor and the validated spans."""

    peer: EndpointInfo
    remote: BufferDesc
    local: torch.Tensor
    spans: np.ndarray


def check_ranges(remote: BufferDesc, local: BufferDesc, ranges: Sequence[Range] | np.ndarray) -> np.ndarray:
    """Ranges as an ``(n, 3)`` int64 array, empty spans dropped; out-of-bounds or negative spans raise."""
    spans = np.asarray(ranges, dtype=np.int64).reshape(-1, 3) if len(ranges) else np.zeros((0, 3), np.int64)
    if (spans < 0).any():
        raise TransportError("ranges must be non-negative (remote_offset, local_offset, nbytes)")
    spans = spans[spans[:, 2] > 0]
    for column, desc, side in ((0, remote, "remote"), (1, local, "local")):
        ends = spans[:, column] + spans[:, 2]
        if len(ends) and int(ends.max()) > desc.nbytes:
            bad = int(np.argmax(ends > desc.nbytes))
            raise TransportError(
                f"range {tuple(int(x) for x in spans[bad])} ends at byte {int(ends[bad])}, "
                f"past the {desc.nbytes}-byte {side} buffer {desc.endpoint}#{desc.buffer_id}"
            )
    return coalesce(spans)


def merged_intervals(spans: np.ndarray, nbytes: int) -> np.ndarray:
    """``(offset, nbytes)`` spans as sorted, disjoint ``[start, end)`` intervals; spans past ``nbytes`` raise."""
    if (spans < 0).any() or (spans > nbytes).any() or (spans[:, 0] + spans[:, 1] > nbytes).any():
        raise TransportError(f"granted spans must lie within the {nbytes}-byte buffer")
    spans = spans[spans[:, 1] > 0]
    intervals = np.stack([spans[:, 0], spans[:, 0] + spans[:, 1]], axis=1)
    intervals = intervals[np.argsort(intervals[:, 0], kind="stable")]
    merged: list[list[int]] = []
    for start, end in intervals.tolist():
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return np.array(merged, dtype=np.int64).reshape(-1, 2)


def coalesce(spans: np.ndarray) -> np.ndarray:
    """Merge consecutive spans that continue each other on both sides (order kept)."""
    if len(spans) < 2:
        return spans
    follows = (spans[1:, 0] == spans[:-1, 0] + spans[:-1, 2]) & (spans[1:, 1] == spans[:-1, 1] + spans[:-1, 2])
    if not follows.any():
        return spans
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    merged = spans[starts].copy()
    merged[:, 2] = np.add.reduceat(spans[:, 2], starts)
    return merged


class Read(NamedTuple):
    """One read of a batch: ``ranges`` of ``remote`` into ``local`` (as :meth:`Transport.read` takes them)."""

    remote: BufferDesc
    local: BufferDesc
    ranges: Sequence[Range] | np.ndarray


class PendingReads:
    """Reads started by :meth:`Transport.start_reads`; :meth:`wait` returns once every byte is in place."""

    def __init__(self, nbytes: int, started: float, finish: Callable[[], None] | None = None) -> None:
        self.nbytes, self.started, self._finish = nbytes, started, finish
        self._stats = None if finish is not None else TransferStats(nbytes, time.perf_counter() - started)

    def wait(self) -> TransferStats:
        """Block until done; the seconds run from the start of the batch. Idempotent."""
        if self._stats is None:
            assert self._finish is not None
            self._finish()
            self._stats = TransferStats(self.nbytes, time.perf_counter() - self.started)
        return self._stats


class Transport(ABC):
    """One endpoint of a point-to-point byte mover; one per process, used from one thread.

    Contract:
    - ``register`` a contiguous 1-D uint8 tensor once (at init) and keep it alive; the returned
      ``BufferDesc`` is picklable and stays valid until ``close``. ``registrations`` counts them.
    - Register every buffer a peer will read *before* sending it ``endpoint_info()``.
    - ``connect(peer)`` once per peer, before the first ``read`` from it.
    - ``read(remote, local, ranges)`` pulls ``remote[ro:ro+n]`` into ``local[lo:lo+n]`` for every range, all in
      one go, and returns when the bytes are in ``local``. The server does nothing per read (one-sided) or
      answers from a background thread / actor method; it may overwrite a buffer once every read of it returned.
    - ``start_reads(reads)`` starts a batch of reads at once and returns a :class:`PendingReads` (transports that
      can leave them in flight do; the others read before returning); ``prepare(reads)`` does, once, at init,
      whatever a later batch of the same reads would otherwise do the first time (so a first sync costs what the
      next ones do). The local buffers of a batch must not be touched until it was waited for.
    - ``close()`` releases registrations and connections; the endpoint is unusable afterwards.
    """

    name: ClassVar[str]
    extra: ClassVar[str] = ""  # pip extra that provides the optional dependency, "" if none
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    """Device types ("cpu", "cuda") of the buffers this transport moves."""
    two_sided: ClassVar[bool] = False
    """Servers answer reads themselves: a server must ``connect`` to its readers as well as they to it."""
    group_member: ClassVar[bool] = False
    """Every endpoint of a run belongs to one group built at construction: :meth:`open` needs a Membership."""
    rejoinable: ClassVar[bool] = True
    """A restarted peer can connect again (so engine replicas may die and rejoin: fault injection)."""
    needs_actor: ClassVar[bool] = False
    """The endpoint must live in a Ray actor that mixes in ``ServesSlots`` (Ray-object transports)."""
    actor_group: ClassVar[str | None] = None
    """Backend of the Ray collective group the launcher creates over every rank actor first (``rdt-gloo``)."""
    strided: ClassVar[bool] = False
    """Reads run 2-D copy plans (``kvmove.transport.copies``): a strided region costs a copy per pattern, not per
    row, so planners may read regions of many short rows directly."""
    shares_devices: ClassVar[bool] = True
    """Two endpoints may live on one GPU (trainer and engine ranks colocated); NCCL's cannot."""
    maps_peers: ClassVar[bool] = False
    """A *mapped peer view*: once connected, :meth:`mapped` gives a peer's registered buffer as a local tensor that
    kernels of this process read in place (cuda-ipc: the opened IPC handle; shm: the shared pages), so an engine
    may compute from a trainer's arena (quantize it into its parameters) instead of reading bytes first."""

    def __init__(self) -> None:
        self.endpoint = f"{self.name}-{uuid.uuid4().hex[:12]}"
        self.registrations = 0
        self._buffers: dict[int, torch.Tensor] = {}
        self._peers: dict[str, EndpointInfo] = {}
        self._closed = False
        self._checked: dict[tuple[int, BufferDesc, BufferDesc], tuple[Any, np.ndarray]] = {}
        self._prepared_spans: dict[int, np.ndarray] = {}
        """The checked spans of prepared reads, by identity (held here, so an id is never reused)."""
        self.executed: dict[str, int] = {}
        """Bytes moved by each copy executor (``kvmove.transport.executors``; "views": torch copies) since
        :meth:`take_executed`; transports that run copy plans fill it."""

    @classmethod
    def open(cls, membership: Membership | None = None, device: str = "cpu") -> Transport:
        """The endpoint of one rank on ``device``; ``membership`` places it in the run's group (``group_member``
        transports need one, the others ignore it)."""
        return cls()

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this transport's dependencies import here; never raises."""

    def register(self, buf: torch.Tensor) -> BufferDesc:
        """Register ``buf`` (contiguous 1-D uint8) once; reads into or out of it need no further registration."""
        self._check_open()
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise TransportError(f"register needs a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        if any(b.data_ptr() == buf.data_ptr() and b.numel() == buf.numel() for b in self._buffers.values()):
            raise TransportError("buffer is already registered with this endpoint (register once, reuse the desc)")
        buffer_id = len(self._buffers)
        self._register(buf, buffer_id)
        self._buffers[buffer_id] = buf
        self.registrations += 1
        return BufferDesc(
            self.name, self.endpoint, buffer_id, buf.numel(), buf.data_ptr(), buf.device.type, max(buf.get_device(), 0)
        )

    @abstractmethod
    def endpoint_info(self) -> EndpointInfo:
        """Everything a peer needs to connect to (and read from) this endpoint; picklable."""

    def connect(self, peer: EndpointInfo) -> None:
        """Make ``peer``'s registered buffers readable from here; call again to refresh it."""
        self._check_open()
        if peer.transport != self.name:
            raise TransportError(f"cannot connect a {self.name} endpoint to a {peer.transport} endpoint")
        self._connect(peer)
        self._peers[peer.endpoint] = peer

    def read(self, remote: BufferDesc, local: BufferDesc, ranges: Sequence[Range] | np.ndarray) -> TransferStats:
        """Pull every ``(remote_offset, local_offset, nbytes)`` range of ``remote`` into ``local``; blocks."""
        self._check_open()
        peer = self._peers.get(remote.endpoint)
        if peer is None:
            raise TransportError(f"remote buffer belongs to {remote.endpoint!r}, which this endpoint never connected")
        if local.endpoint != self.endpoint or local.buffer_id not in self._buffers:
            raise TransportError(
                f"local buffer {local.endpoint}#{local.buffer_id} is not registered with this endpoint"
            )
        spans = self._spans(Read(remote, local, ranges), remember=False)  # prepared ranges: checked at init
        start = time.perf_counter()
        if len(spans):
            self._read(peer, remote, self._buffers[local.buffer_id], spans)
        return TransferStats(int(spans[:, 2].sum()), time.perf_counter() - start)

    def start_reads(self, reads: Sequence[Read]) -> PendingReads:
        """Start every read of ``reads`` (checked as :meth:`read` checks one); wait on the result for the bytes."""
        start = time.perf_counter()
        items = self._items(reads)
        finish = self._start(items) if items else None
        return PendingReads(sum(int(i.spans[:, 2].sum()) for i in items), start, finish)

    def prepare(self, reads: Sequence[Read]) -> None:
        """Do at init what the first batch of these reads would do (peer access, copy plans, NIXL requests).

        The reads' ranges are checked here once: a later batch holding the same range objects (a sync plan's
        arrays, read every sync) reuses the checked spans instead of validating them again (a pipeline-stage
        boundary is a million spans). Ranges handed to ``prepare`` must not change afterwards (arrays are made
        read-only)."""
        items = self._items(reads, remember=True)
        if items:
            self._prepare(items)

    def mapped(self, remote: BufferDesc) -> torch.Tensor:
        """``remote`` (a connected peer's registered buffer) as a uint8 tensor of this process aliasing its bytes
        (transports with ``maps_peers``); writing it writes the peer's buffer."""
        self._check_open()
        if not self.maps_peers:
            raise TransportError(f"the {self.name} transport cannot map a peer's buffer into this process")
        if remote.endpoint not in self._peers:
            raise TransportError(f"remote buffer belongs to {remote.endpoint!r}, which this endpoint never connected")
        view = self._mapped(remote)
        if view.numel() != remote.nbytes:
            raise TransportError(
                f"mapped buffer {remote.endpoint}#{remote.buffer_id} has {view.numel()} bytes, "
                f"its peer registered {remote.nbytes}"
            )
        return view

    def take_executed(self) -> dict[str, int]:
        """Bytes moved per copy executor since the last call (and reset)."""
        out, self.executed = self.executed, {}
        return out

    def _count(self, executor: str, nbytes: int) -> None:
        self.executed[executor] = self.executed.get(executor, 0) + nbytes

    def _spans(self, r: Read, remember: bool) -> np.ndarray:
        """``r``'s checked spans; remembered by the identity of its ranges when ``remember``."""
        key = (id(r.ranges), r.remote, r.local)
        hit = self._checked.get(key)
        if hit is not None and hit[0] is r.ranges:
            return hit[1]
        spans = check_ranges(r.remote, r.local, r.ranges)
        if remember and isinstance(r.ranges, np.ndarray):
            if len(self._checked) >= MAX_CHECKED:
                self._checked.clear()
                self._prepared_spans.clear()
            r.ranges.flags.writeable = False
            self._checked[key] = (r.ranges, spans)  # NOTE: holding the ranges keeps their id from being reused
            self._prepared_spans[id(spans)] = spans
        return spans

    def is_prepared(self, spans: np.ndarray) -> bool:
        """Whether ``spans`` are the checked spans of a prepared read (the same array every batch reads them)."""
        return self._prepared_spans.get(id(spans)) is spans

    def _items(self, reads: Sequence[Read], remember: bool = False) -> list[ReadItem]:
        self._check_open()
        out = []
        for r in reads:
            peer = self._peers.get(r.remote.endpoint)
            if peer is None:
                raise TransportError(
                    f"remote buffer belongs to {r.remote.endpoint!r}, which this endpoint never connected"
                )
            if r.local.endpoint != self.endpoint or r.local.buffer_id not in self._buffers:
                raise TransportError(
                    f"local buffer {r.local.endpoint}#{r.local.buffer_id} is not registered with this endpoint"
                )
            spans = self._spans(r, remember)
            if len(spans):
                out.append(ReadItem(peer, r.remote, self._buffers[r.local.buffer_id], spans))
        return out

    def close(self) -> None:
        """Release registrations and connections; idempotent."""
        if not self._closed:
            self._closed = True
            self._close()
            self._checked.clear()
            self._prepared_spans.clear()
            self._buffers.clear()
            self._peers.clear()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.name} endpoint {self.endpoint} is closed")

    @abstractmethod
    def _register(self, buf: torch.Tensor, buffer_id: int) -> None: ...

    def _connect(self, peer: EndpointInfo) -> None:  # noqa: B027 - most transports need nothing here
        pass

    @abstractmethod
    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        """Move ``spans`` (validated ``(n, 3)`` int64, non-empty) from ``remote`` into ``local``."""

    def _start(self, items: list[ReadItem]) -> Callable[[], None] | None:
        """Start the (checked, non-empty) reads; return what finishes them, or None when they are done already
        (the default: one :meth:`_read` after another)."""
        for i in items:
            self._read(i.peer, i.remote, i.local, i.spans)
        return None

    def _prepare(self, items: list[ReadItem]) -> None:  # noqa: B027 - most transports need nothing here
        pass

    def _mapped(self, remote: BufferDesc) -> torch.Tensor:
        """The mapped view of a connected peer's buffer (transports with ``maps_peers`` override it)."""
        raise TransportError(f"the {self.name} transport cannot map a peer's buffer into this process")

    def _close(self) -> None:  # noqa: B027
        pass
