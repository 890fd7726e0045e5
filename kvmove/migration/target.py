"""Target side of a migration: match -> reserve (lock the cached prefix, allocate the tail) -> pull -> commit.

One migration id covers every tensor-parallel rank of the worker: the device side (the lock on the matched prefix,
the device pages of the tail, shared by all ranks' pools) is reserved once, each rank owns its host pages and
pulls its own KV heads into them. A migration is PENDING until every rank pulled (FILLED), then leaves by
``commit`` (tail loaded into the device pages and cached in the radix tree, ready to resume without recompute),
``abort`` or ``expire`` (the watchdog). Leaving releases exactly what reserving took; ``check_integrity`` holds after
every call, including refused ones, which change nothing.

Locks: ``_lock`` guards the table of migrations and is only held to read or change it, never while bytes move;
the worker's lock is taken after it, briefly, to touch the radix tree and the device page table. A pull marks
its rank in flight under ``_lock``, moves bytes with no lock held, and settles under ``_lock`` again: the watchdog
never expires a migration with a pull in flight, and ``abort`` of one only detaches it; its pages are released
when the pull returns, so no pull ever lands in released pages. ``commit`` detaches the migration, then loads
its pages onto the device with no lock held (they belong to it alone) and inserts them under the worker's lock.

Trust: a pull comes only from valid (and, with an allow-list, allowed) source addresses, and every pull of a
migration carries the source's checksum of the pages it staged (all its ranks, all heads). ``commit`` checks the
device pages it loaded, the ones the radix tree would own, against it: pages corrupted in transit or overwritten
between pull and commit are refused and released, never cached. One migration, and the pending migrations
allocated from one client address, hold at most their ``PoolShare`` of the pools.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache import head_slices, pages_digest, pages_to_slots, slots_to_pages
from kvmove.migration.endpoint import HostEndpoint
from kvmove.migration.errors import (
    ChecksumMismatchError,
    MigrationConflictError,
    MigrationError,
    OutOfPagesError,
    PeerMismatchError,
    UnknownMigrationError,
)
from kvmove.migration.messages import (
    AbortTransferResp,
    AllocateTokenForTransferReq,
    AllocateTokenForTransferResp,
    CommitTransferReq,
    CommitTransferResp,
    GetRequestExtraTokenSizeReq,
    GetRequestExtraTokenSizeResp,
    PullKVReq,
    PullKVResp,
    RankKVIndices,
)
from kvmove.migration.peers import PeerPolicy
from kvmove.migration.session import check_compatible, parse_geometry
from kvmove.migration.share import PoolShare
from kvmove.reference import ExportedKV, RolloutWorker
from kvmove.transport import TransferStats


@dataclass
class PendingMigration:
    """An allocated, uncommitted migration: ``head`` locks the matched prefix (``node`` None if nothing matched);
    ``host_pages[r]`` are rank ``r``'s pages for the tail; ``active_at`` is the allocation or the last pull's end
    (what the watchdog's timeout counts from)."""

    migration_id: str
    token_ids: tuple[int, ...]
    extra_key: str | None
    weight_version: str
    matched_tokens: int
    head: ExportedKV
    host_pages: list[torch.Tensor]
    device_pages: torch.Tensor
    page_size: int
    active_at: float
    filled: set[int] = field(default_factory=set)
    pulling: set[int] = field(default_factory=set)
    cancelled: bool = False
    peer: str = ""  # the client address that allocated it (its pool share)
    checksum: str = ""  # the source's digest of the tail's pages, from its pulls

    def kv_indices(self, rank: int) -> list[int]:
        """Rank ``rank``'s host token slots of the tail, what SGLang clients expect (``len == extra_token_size``)."""
        return pages_to_slots(self.host_pages[rank], self.page_size).tolist()

    @property
    def tail_pages(self) -> int:
        return self.device_pages.numel()


class Reserved(NamedTuple):
    """Pages reserved for an incoming transfer: every rank's host pages, and the device pages the ranks share."""

    host: list[torch.Tensor]
    device: torch.Tensor


class MigrationTarget:
    """``endpoints[r]``: the host pool and transport of tensor-parallel rank ``r`` (pp is always 0)."""

    def __init__(
        self,
        worker: RolloutWorker,
        worker_lock: threading.RLock,
        endpoints: list[HostEndpoint],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        peers: PeerPolicy = PeerPolicy(),
        share: PoolShare = PoolShare(),
    ) -> None:
        self.worker, self.worker_lock, self.endpoints = worker, worker_lock, endpoints
        self.timeout_s, self.clock = timeout_s, clock
        self.peers, self.share = peers, share
        self.page_size = worker.config.page_size
        self.pending: dict[str, PendingMigration] = {}
        self._detached: dict[str, PendingMigration] = {}  # left `pending`, still holding pages (commit, late pull)
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> HostEndpoint:
        """Rank 0's endpoint."""
        return self.endpoints[0]

    def extra_token_size(self, req: GetRequestExtraTokenSizeReq) -> GetRequestExtraTokenSizeResp:
        """How many page-aligned tokens of ``input_ids`` this worker caches already, and how many it lacks."""
        total = self._total(req.input_ids)
        with self.worker_lock:
            have = self.worker.export_request_kv(tokens=req.input_ids[:total], extra_key=req.extra_key)
        return GetRequestExtraTokenSizeResp(
            extra_token_size=total - have.num_tokens, matched_token_size=have.num_tokens, total_token_size=total
        )

    def allocate(self, req: AllocateTokenForTransferReq, peer: str = "") -> AllocateTokenForTransferResp:
        """Lock the cached prefix, reserve device pages and every rank's host pages for the tail, record it (allocated
        by the client at address ``peer``)."""
        total, extra = self._total(req.input_ids), req.extra_token_size
        if extra < 0 or extra % self.page_size or extra > total:
            raise MigrationError(f"extra_token_size {extra} is not whole pages of {self.page_size} within {total}")
        with self._lock:
            mid = req.migration_id or uuid.uuid4().hex
            if mid in self.pending or mid in self._detached:
                raise MigrationConflictError(f"migration_id {mid} is already pending")
            self._check_share(extra // self.page_size, peer)
            mig = self.pending[mid] = self._reserve(mid, req.input_ids[:total], req.extra_key, extra)
            mig.peer = peer
        ranks = [RankKVIndices(tp=r, pp=0, kv_indices=mig.kv_indices(r)) for r in range(len(self.endpoints))]
        return AllocateTokenForTransferResp(migration_id=mid, per_rank_kv_indices=ranks)

    def pull(self, req: PullKVReq) -> PullKVResp:
        """Rank ``(req.tp, req.pp)`` pulls the KV heads it holds from the source ranks' staged pages into its host
        pages of the one pending migration these slots belong to. No lock is held while the bytes move."""
        rank = self._rank(req.tp, req.pp)
        for s in req.sources:
            self.peers.check(s.endpoint.session_id)
        with self._lock:
            mig = self._owner_of(req, rank)
            if mig.checksum and mig.checksum != req.checksum:
                raise MigrationConflictError(f"migration_id {mig.migration_id}: its pulls disagree on the checksum")
            mig.checksum = req.checksum
            mig.pulling.add(rank)
        try:
            stats = self._pull_rank(mig, rank, req)
        except BaseException:
            with self._lock:
                mig.pulling.discard(rank)
                self._settle(mig)
            raise
        with self._lock:
            mig.pulling.discard(rank)
            mig.active_at = self.clock()
            if mig.cancelled:
                self._settle(mig)
                raise UnknownMigrationError(f"migration_id {mig.migration_id} was aborted during its pull")
            mig.filled.add(rank)
        return PullKVResp(
            migration_id=mig.migration_id,
            bytes=stats.bytes,
            seconds=stats.seconds,
            transport=self.endpoints[rank].transport_name,
        )

    def commit(self, req: CommitTransferReq) -> CommitTransferResp:
        """Load every rank's pulled tail into the device pages and insert it into the radix tree; release."""
        with self._lock:
            mig = self._get(req.migration_id)
            if mig.pulling:
                raise MigrationConflictError(f"migration_id {mig.migration_id}: a transfer is still in flight")
            missing = sorted(set(range(len(self.endpoints))) - mig.filled)
            if mig.tail_pages and missing:
                raise MigrationConflictError(
                    f"migration_id {mig.migration_id}: no K/V was transferred yet to rank(s) {missing}"
                )
            self._detached[mig.migration_id] = self.pending.pop(mig.migration_id)
        try:
            return self._commit(mig)
        finally:
            with self._lock, self.worker_lock:
                del self._detached[mig.migration_id]
                self._release(mig)

    def abort(self, migration_id: str) -> AbortTransferResp:
        """Release a pending migration now, or (a pull in flight) as soon as that pull returns."""
        with self._lock:
            mig = self._get(migration_id)
            pages = mig.tail_pages
            del self.pending[migration_id]
            mig.cancelled = True
            self._detached[migration_id] = mig
            self._settle(mig)
        return AbortTransferResp(released_pages=pages)

    def expire(self) -> list[str]:
        """Roll back every migration idle longer than the watchdog timeout (none with a pull in flight)."""
        now = self.clock()
        with self._lock:
            old = [m for m in self.pending.values() if not m.pulling and now - m.active_at > self.timeout_s]
            with self.worker_lock:
                for mig in old:
                    del self.pending[mig.migration_id]
                    self._release(mig)
        return [m.migration_id for m in old]

    def host_pages_in_use(self, rank: int = 0) -> int:
        """Host pages of rank ``rank`` held by migrations (call under ``locked``, or accept a passing count)."""
        return sum(m.host_pages[rank].numel() for m in (*self.pending.values(), *self._detached.values()))

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the migration table still (for integrity checks); take it before the worker's lock, never after."""
        with self._lock:
            yield

    # -- internals -------------------------------------------------------------------------------------------------

    def _reserve(self, mid: str, tokens: list[int], extra_key: str | None, extra: int) -> PendingMigration:
        with self.worker_lock:
            head = self.worker.export_request_kv(tokens=tokens, extra_key=extra_key, lock=True)
            try:
                if head.num_tokens + extra != len(tokens):
                    raise MigrationConflictError(
                        f"matched_aligned ({head.num_tokens}) + extra_token_size ({extra}) != total_aligned "
                        f"({len(tokens)}): the cache changed, ask get_request_extra_token_size again"
                    )
                host, device = self._alloc(extra // self.page_size)
            except BaseException:
                if head.node is not None:
                    self.worker.unlock_export(head)
                raise
        version = self.worker.weight_version
        return PendingMigration(
            mid, tuple(tokens), extra_key, version, head.num_tokens, head, host, device, self.page_size, self.clock()
        )

    def _alloc(self, n: int) -> Reserved:
        """Every rank's host pages, then the device pages (shared by the ranks' pools); all or nothing."""
        host: list[torch.Tensor] = []
        try:
            for r, endpoint in enumerate(self.endpoints):
                pages = endpoint.alloc(n)
                if pages is None:
                    raise OutOfPagesError(f"host pool alloc OOM on rank {r}: requested {n * self.page_size} tokens")
                host.append(pages)
            try:
                return Reserved(host, self.worker.alloc_import_pages(n))
            except KVCacheError as exc:
                raise OutOfPagesError(f"device pool alloc OOM: requested {n * self.page_size} tokens ({exc})") from exc
        except BaseException:
            for endpoint, pages in zip(self.endpoints, host, strict=False):
                endpoint.free(pages)
            raise

    def _pull_rank(self, mig: PendingMigration, rank: int, req: PullKVReq) -> TransferStats:
        """Read this rank's heads from the source ranks that hold them (each source read at most once)."""
        endpoint = self.endpoints[rank]
        if not req.sources:
            raise MigrationError("the pull names no source rank")
        for s in req.sources:
            check_compatible(endpoint.pool.geometry, mig.weight_version, s.endpoint.geometry, s.endpoint.weight_version)
        geometries = [parse_geometry(s.endpoint.geometry) for s in req.sources]
        try:
            plan = head_slices(endpoint.pool.geometry, geometries)
        except KVCacheError as exc:
            raise PeerMismatchError(f"the source ranks cannot serve rank {rank}: {exc}") from exc
        total = TransferStats(0, 0.0)
        for i in sorted({p.source for p in plan}):
            src = req.sources[i]
            pieces = [p for p in plan if p.source == i]
            got = endpoint.pull(src.endpoint, src.src_pages, mig.host_pages[rank], geometries[i], pieces)
            total = TransferStats(total.bytes + got.bytes, total.seconds + got.seconds)
        return total

    def _commit(self, mig: PendingMigration) -> CommitTransferResp:
        self._check_version(mig)
        start = time.perf_counter()
        if mig.tail_pages:  # NOTE: no lock: these device and host pages belong to this migration alone
            for endpoint, pool, host in zip(self.endpoints, self.worker.pools, mig.host_pages, strict=True):
                endpoint.pool.load_back(pool, mig.device_pages, host)
            self._check_checksum(mig)
        loaded = time.perf_counter() - start
        existing = mig.matched_tokens
        with self.worker_lock:
            self._check_version(mig)
            if mig.tail_pages:
                existing = self.worker.import_kv(list(mig.token_ids), mig.extra_key, mig.device_pages).existing_tokens
                mig.device_pages = mig.device_pages[:0]  # NOTE: owned by the radix tree now
        raced = existing > mig.matched_tokens
        return CommitTransferResp(
            matched_after_commit=len(mig.token_ids),
            message="tree raced ahead during migration window; duplicate pages freed" if raced else "",
            load_seconds=loaded,
        )

    def _check_checksum(self, mig: PendingMigration) -> None:
        """The device pages about to be cached (every rank's heads) against the source's digest of what it staged."""
        got = pages_digest([(pool.page_views(), mig.device_pages) for pool in self.worker.pools])
        if got != mig.checksum:
            raise ChecksumMismatchError(
                f"migration_id {mig.migration_id}: its pages differ from what the source staged (corrupted in transit "
                "or changed between pull and commit); the migration was released and nothing was cached"
            )

    def _check_share(self, pages: int, peer: str) -> None:
        held = sum(m.tail_pages for m in (*self.pending.values(), *self._detached.values()) if m.peer == peer)
        pool = min(self.endpoints[0].pool.num_pages, self.worker.pool.num_pages)
        self.share.check(pages, held, pool, peer, "host pool")

    def _check_version(self, mig: PendingMigration) -> None:
        if self.worker.weight_version != mig.weight_version:
            raise MigrationConflictError(
                f"weight version changed from {mig.weight_version!r} to {self.worker.weight_version!r}"
            )

    def _settle(self, mig: PendingMigration) -> None:
        """Under ``_lock``: release a cancelled migration once no pull of it is in flight."""
        if mig.cancelled and not mig.pulling and self._detached.pop(mig.migration_id, None) is not None:
            with self.worker_lock:
                self._release(mig)

    def _release(self, mig: PendingMigration) -> None:
        if mig.device_pages.numel():
            self.worker.free_import_pages(mig.device_pages)
            mig.device_pages = mig.device_pages[:0]
        for endpoint, pages in zip(self.endpoints, mig.host_pages, strict=True):
            if pages.numel():
                endpoint.free(pages)
        mig.host_pages = [p[:0] for p in mig.host_pages]
        if mig.head.node is not None:
            self.worker.unlock_export(mig.head)
            mig.head = mig.head._replace(node=None)

    def _owner_of(self, req: PullKVReq, rank: int) -> PendingMigration:
        pages = slots_to_pages(req.kv_indices, self.page_size).tolist()
        for mig in self.pending.values():
            if pages and mig.host_pages[rank].tolist() == pages:
                if mig.token_ids != tuple(req.input_ids) or mig.extra_key != req.extra_key:
                    raise MigrationConflictError("kv_indices belong to a migration of other tokens or extra_key")
                if mig.matched_tokens != req.matched_token_size:
                    raise MigrationConflictError(
                        f"matched_token_size {req.matched_token_size} != {mig.matched_tokens} allocated for it"
                    )
                if rank in mig.filled or rank in mig.pulling:
                    raise MigrationConflictError(
                        f"migration_id {mig.migration_id} was already transferred to rank {rank}"
                    )
                return mig
        raise UnknownMigrationError(f"kv_indices were not allocated for any pending migration on rank {rank}")

    def _rank(self, tp: int, pp: int) -> int:
        if pp != 0 or not 0 <= tp < len(self.endpoints):
            raise UnknownMigrationError(f"no rank tp={tp} pp={pp} here (tp size {len(self.endpoints)}, pp size 1)")
        return tp

    def _get(self, migration_id: str) -> PendingMigration:
        mig = self.pending.get(migration_id)
        if mig is None:
            raise UnknownMigrationError(f"migration_id {migration_id} not found (timed out, aborted or committed?)")
        return mig

    def _total(self, input_ids: list[int]) -> int:
        return len(input_ids) // self.page_size * self.page_size
