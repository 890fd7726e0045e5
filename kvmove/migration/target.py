"""Target side of a migration: match -> reserve (lock the cached prefix, allocate the tail) -> pull -> commit.

Every migration id is in exactly one state: PENDING (after ``allocate``), FILLED (after ``pull``), then gone by
``commit`` (tail cached in the worker's radix tree, on device pages, ready to resume without recompute), ``abort``
or ``expire`` (the watchdog). Leaving a state releases exactly what entering it took: the lock on the matched
prefix, the host pages and the device pages reserved for the tail. ``check_integrity`` holds after every call,
including refused ones, which change nothing.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmove.engines.reference import ExportedKV, RolloutWorker
from kvmove.errors import KVCacheError
from kvmove.kvcache import pages_to_slots, slots_to_pages
from kvmove.migration.endpoint import HostEndpoint
from kvmove.migration.errors import (
    MigrationConflictError,
    MigrationError,
    OutOfPagesError,
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
from kvmove.migration.session import check_compatible


@dataclass
class PendingMigration:
    """An allocated, uncommitted migration: ``head`` locks the matched prefix (``node`` None if nothing matched)."""

    migration_id: str
    token_ids: tuple[int, ...]
    extra_key: str | None
    weight_version: str
    matched_tokens: int
    head: ExportedKV
    host_pages: torch.Tensor
    device_pages: torch.Tensor
    page_size: int
    created_at: float
    filled: bool = False

    @property
    def kv_indices(self) -> list[int]:
        """The host token slots of the tail, what SGLang clients expect (``len == extra_token_size``)."""
        return pages_to_slots(self.host_pages, self.page_size).tolist()


class MigrationTarget:
    def __init__(
        self,
        worker: RolloutWorker,
        worker_lock: threading.RLock,
        endpoint: HostEndpoint,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker, self.worker_lock, self.endpoint = worker, worker_lock, endpoint
        self.timeout_s, self.clock = timeout_s, clock
        self.page_size = worker.config.page_size
        self.pending: dict[str, PendingMigration] = {}
        self._lock = threading.Lock()

    def extra_token_size(self, req: GetRequestExtraTokenSizeReq) -> GetRequestExtraTokenSizeResp:
        """How many page-aligned tokens of ``input_ids`` this rank caches already, and how many it lacks."""
        total = self._total(req.input_ids)
        with self.worker_lock:
            have = self.worker.export_request_kv(tokens=req.input_ids[:total], extra_key=req.extra_key)
        return GetRequestExtraTokenSizeResp(
            extra_token_size=total - have.num_tokens, matched_token_size=have.num_tokens, total_token_size=total
        )

    def allocate(self, req: AllocateTokenForTransferReq) -> AllocateTokenForTransferResp:
        """Lock the cached prefix, reserve host and device pages for the tail, record the migration."""
        total, extra = self._total(req.input_ids), req.extra_token_size
        if extra < 0 or extra % self.page_size or extra > total:
            raise MigrationError(f"extra_token_size {extra} is not whole pages of {self.page_size} within {total}")
        with self._lock:
            mid = req.migration_id or uuid.uuid4().hex
            if mid in self.pending:
                raise MigrationConflictError(f"migration_id {mid} is already pending")
            self.pending[mid] = self._reserve(mid, req.input_ids[:total], req.extra_key, extra)
            kv = self.pending[mid].kv_indices
        return AllocateTokenForTransferResp(
            migration_id=mid, per_rank_kv_indices=[RankKVIndices(tp=0, pp=0, kv_indices=kv)]
        )

    def pull(self, req: PullKVReq) -> PullKVResp:
        """Pull the source's staged pages into the host pages of the one pending migration these slots belong to."""
        with self._lock:
            mig = self._owner_of(req)
            check_compatible(
                self.endpoint.pool.geometry, mig.weight_version, req.source.geometry, req.source.weight_version
            )
            stats = self.endpoint.pull(req.source, req.src_pages, mig.host_pages)
            mig.filled = True
        return PullKVResp(
            migration_id=mig.migration_id,
            bytes=stats.bytes,
            seconds=stats.seconds,
            transport=self.endpoint.transport_name,
        )

    def commit(self, req: CommitTransferReq) -> CommitTransferResp:
        """Load the pulled tail into the device pages and insert it into the radix tree; release the locks."""
        with self._lock:
            mig = self._get(req.migration_id)
            if mig.host_pages.numel() and not mig.filled:
                raise MigrationConflictError(f"migration_id {mig.migration_id}: no K/V was transferred yet")
            del self.pending[mig.migration_id]
            with self.worker_lock:
                return self._commit(mig)

    def abort(self, migration_id: str) -> AbortTransferResp:
        with self._lock:
            mig = self._get(migration_id)
            del self.pending[migration_id]
            with self.worker_lock:
                self._release(mig)
        return AbortTransferResp(released_pages=mig.host_pages.numel())

    def expire(self) -> list[str]:
        """Roll back every migration pending longer than the watchdog timeout; returns their ids."""
        now = self.clock()
        with self._lock:
            old = [m for m in self.pending.values() if now - m.created_at > self.timeout_s]
            with self.worker_lock:
                for mig in old:
                    del self.pending[mig.migration_id]
                    self._release(mig)
        return [m.migration_id for m in old]

    @property
    def host_pages_in_use(self) -> int:
        return sum(m.host_pages.numel() for m in self.pending.values())

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
        return PendingMigration(
            mid,
            tuple(tokens),
            extra_key,
            self.worker.weight_version,
            head.num_tokens,
            head,
            host,
            device,
            self.page_size,
            self.clock(),
        )

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = self.endpoint.alloc(n)
        if host is None:
            raise OutOfPagesError(f"host pool alloc OOM: requested {n * self.page_size} tokens")
        try:
            return host, self.worker.alloc_import_pages(n)
        except KVCacheError as exc:
            self.endpoint.free(host)
            raise OutOfPagesError(f"device pool alloc OOM: requested {n * self.page_size} tokens ({exc})") from exc

    def _commit(self, mig: PendingMigration) -> CommitTransferResp:
        existing = mig.matched_tokens
        try:
            if self.worker.weight_version != mig.weight_version:
                raise MigrationConflictError(
                    f"weight version changed from {mig.weight_version!r} to {self.worker.weight_version!r}"
                )
            if mig.host_pages.numel():
                self.endpoint.pool.load_back(self.worker.pool, mig.device_pages, mig.host_pages)
                existing = self.worker.import_kv(list(mig.token_ids), mig.extra_key, mig.device_pages).existing_tokens
        except BaseException:
            self._release(mig)
            raise
        mig.device_pages = mig.device_pages[:0]  # NOTE: owned by the radix tree now
        self._release(mig)
        raced = existing > mig.matched_tokens
        return CommitTransferResp(
            matched_after_commit=len(mig.token_ids),
            message="tree raced ahead during migration window; duplicate pages freed" if raced else "",
        )

    def _release(self, mig: PendingMigration) -> None:
        if mig.device_pages.numel():
            self.worker.free_import_pages(mig.device_pages)
        if mig.host_pages.numel():
            self.endpoint.free(mig.host_pages)
        if mig.head.node is not None:
            self.worker.unlock_export(mig.head)

    def _owner_of(self, req: PullKVReq) -> PendingMigration:
        pages = slots_to_pages(req.kv_indices, self.page_size).tolist()
        for mig in self.pending.values():
            if mig.host_pages.tolist() == pages and pages:
                if mig.token_ids != tuple(req.input_ids) or mig.extra_key != req.extra_key:
                    raise MigrationConflictError("kv_indices belong to a migration of other tokens or extra_key")
                if mig.matched_tokens != req.matched_token_size:
                    raise MigrationConflictError(
                        f"matched_token_size {req.matched_token_size} != {mig.matched_tokens} allocated for it"
                    )
                if mig.filled:
                    raise MigrationConflictError(f"migration_id {mig.migration_id} was already transferred")
                return mig
        raise UnknownMigrationError("kv_indices were not allocated for any pending migration on this rank")

    def _get(self, migration_id: str) -> PendingMigration:
        mig = self.pending.get(migration_id)
        if mig is None:
            raise UnknownMigrationError(f"migration_id {migration_id} not found (timed out, aborted or committed?)")
        return mig

    def _total(self, input_ids: list[int]) -> int:
        return len(input_ids) // self.page_size * self.page_size
