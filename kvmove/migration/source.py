"""Source side of a migration: collect the request's pages along its radix path, stage only the pages the target
lacks in the host pool (device -> host write-back), and have the target pull them.

The source keeps no state between calls: the path stays locked, the staged host pages stay allocated and (over
``http``) readable by the target exactly for the duration of one ``transfer`` (released on success and on every
failure; the target's read grant ends before the pages are freed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kvmove.engines.reference import ExportedKV, RolloutWorker
from kvmove.kvcache import slots_to_pages
from kvmove.migration.endpoint import HostEndpoint
from kvmove.migration.errors import MigrationError, OutOfPagesError
from kvmove.migration.messages import (
    PullKVReq,
    PullKVResp,
    RankSession,
    TransferRequestKVCacheReq,
    TransferRequestKVCacheResp,
    TransferTarget,
)
from kvmove.migration.session import check_layout, check_transport, target_for_rank

SendPull = Callable[[str, PullKVReq], PullKVResp]
"""Asks the target rank at ``session_id`` to pull (the server's HTTP client; tests may call the target directly)."""


class MigrationSource:
    def __init__(
        self,
        worker: RolloutWorker,
        worker_lock: threading.RLock,
        endpoint: HostEndpoint,
        session: Callable[[], RankSession],
        send_pull: SendPull,
    ) -> None:
        self.worker, self.worker_lock, self.endpoint = worker, worker_lock, endpoint
        self.session, self.send_pull = session, send_pull
        self.page_size = worker.config.page_size
        self.staged_pages = 0
        self._count_lock = threading.Lock()

    def transfer(self, req: TransferRequestKVCacheReq) -> TransferRequestKVCacheResp:
        """Send ``input_ids[matched : matched + extra]`` (whole pages) to this rank's target entry; blocks."""
        me = self.session()
        target = target_for_rank(req.target_per_rank, me.tp, me.pp)
        check_layout(me, target.host_kv_data_ptrs, target.host_kv_item_lens)
        check_transport(me.transport, target.transport)
        start, stop = self._window(req)
        if slots_to_pages(target.kv_indices, self.page_size).numel() != (stop - start) // self.page_size:
            raise MigrationError(f"{len(target.kv_indices)} kv_indices for extra_token_size {stop - start}")
        if stop == start:
            return TransferRequestKVCacheResp(transport=self.endpoint.transport_name)
        tokens = req.input_ids[:stop]
        with self.worker_lock:
            exported = self.worker.export_request_kv(tokens=tokens, extra_key=req.extra_key, lock=True)
            try:
                staged = self._stage(exported.pages, start, stop)
            except BaseException:
                self._unlock(exported)
                raise
        try:
            done = self._send(me, target, req, staged)
        finally:
            self._unstage(staged)
            with self.worker_lock:
                self._unlock(exported)
        return TransferRequestKVCacheResp(bytes=done.bytes, seconds=done.seconds, transport=done.transport)

    def _send(
        self, me: RankSession, target: TransferTarget, req: TransferRequestKVCacheReq, staged: torch.Tensor
    ) -> PullKVResp:
        """Let the target read ``staged`` (only those pages, only until it answered) and ask it to pull them."""
        offer = self.endpoint.offer(me.session_id, self.worker.weight_version, staged)
        try:
            pull = PullKVReq(
                input_ids=req.input_ids[: req.matched_token_size + req.extra_token_size],
                extra_key=req.extra_key,
                matched_token_size=req.matched_token_size,
                kv_indices=target.kv_indices,
                src_pages=staged.tolist(),
                source=offer,
            )
            return self.send_pull(target.session_id, pull)
        finally:
            self.endpoint.withdraw(offer)

    def _window(self, req: TransferRequestKVCacheReq) -> tuple[int, int]:
        start, extra = req.matched_token_size, req.extra_token_size
        if start < 0 or extra < 0 or start % self.page_size or extra % self.page_size:
            raise MigrationError(f"matched/extra token sizes {start}/{extra} are not whole pages of {self.page_size}")
        if start + extra > len(req.input_ids):
            raise MigrationError(f"matched + extra = {start + extra} > {len(req.input_ids)} input_ids")
        return start, start + extra

    def _stage(self, pages: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        need = stop // self.page_size
        if pages.numel() < need:
            raise MigrationError(f"source missing pages: have {pages.numel()}, need {need} (possibly evicted)")
        send = pages[start // self.page_size : need]
        staged = self.endpoint.alloc(send.numel())
        if staged is None:
            raise OutOfPagesError(f"source host pool has no room to stage {send.numel()} pages")
        self.endpoint.pool.write_back(self.worker.pool, send, staged)
        with self._count_lock:
            self.staged_pages += staged.numel()
        return staged

    def _unstage(self, staged: torch.Tensor) -> None:
        self.endpoint.free(staged)
        with self._count_lock:
            self.staged_pages -= staged.numel()

    def _unlock(self, exported: ExportedKV) -> None:
        if exported.node is not None:
            self.worker.unlock_export(exported)
