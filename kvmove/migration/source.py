"""Source side of a migration: collect the request's pages along its radix path, stage only the pages the target
lacks in every rank's host pool (device -> host write-back), and have each target rank pull what it holds.

The source keeps no state between calls: the path stays locked, the staged outbox pages stay allocated and readable
by the target exactly for the duration of one ``transfer`` (released on success and on every failure: the target's
offers are withdrawn, then the pages scrubbed, then freed). Every pull carries the checksum of all the staged pages
(all ranks, all heads), which the target checks before it caches them. The target must be a valid (and, with an
allow-list, allowed) peer address; one transfer, and the transfers to one target together, stage at most their
``PoolShare`` of the outbox. The worker's lock is held only to lock and
unlock the path: the copies to the host pool and the pulls run without it, so decoding goes on meanwhile (the
locked pages are never written: cached K/V is immutable).

Every target rank gets one pull naming all source ranks; it reads from each only the KV heads it holds, so workers
of different tensor parallelism exchange exactly the bytes each target rank needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from kvmove.kvcache import pages_digest, slots_to_pages
from kvmove.migration.endpoint import HostEndpoint
from kvmove.migration.errors import MigrationError, OutOfPagesError
from kvmove.migration.messages import (
    PullKVReq,
    PullKVResp,
    PullSource,
    RankSession,
    TransferRequestKVCacheReq,
    TransferRequestKVCacheResp,
    TransferTarget,
)
from kvmove.migration.peers import PeerPolicy
from kvmove.migration.session import check_target
from kvmove.migration.share import PoolShare
from kvmove.reference import ExportedKV, RolloutWorker

SendPull = Callable[[str, PullKVReq], PullKVResp]
"""Asks the target rank at ``session_id`` to pull (the server's HTTP client; tests may call the target directly)."""


class Window(NamedTuple):
    """The token positions ``[start, stop)`` of a request whose K/V moves (whole pages)."""

    start: int
    stop: int


class MigrationSource:
    """``endpoints[r]`` and ``sessions()[r]``: tensor-parallel rank ``r``'s host pool and its session entry."""

    def __init__(
        self,
        worker: RolloutWorker,
        worker_lock: threading.RLock,
        endpoints: list[HostEndpoint],
        sessions: Callable[[], list[RankSession]],
        send_pull: SendPull,
        *,
        peers: PeerPolicy = PeerPolicy(),
        share: PoolShare = PoolShare(),
    ) -> None:
        self.worker, self.worker_lock, self.endpoints = worker, worker_lock, endpoints
        self.sessions, self.send_pull = sessions, send_pull
        self.peers, self.share = peers, share
        self.page_size = worker.config.page_size
        self._staged_for: dict[str, int] = {}  # pages staged per target address (one rank's count)
        self._count_lock = threading.Lock()

    @property
    def staged_pages(self) -> int:
        return sum(e.staged_pages for e in self.endpoints)

    def transfer(self, req: TransferRequestKVCacheReq) -> TransferRequestKVCacheResp:
        """Send ``input_ids[matched : matched + extra]`` (whole pages) to every target rank; blocks until done."""
        mine = self.sessions()
        if not req.target_per_rank:
            raise MigrationError("target_per_rank is empty: no target rank to send to")
        start, stop = self._window(req)
        peer = self.peers.check(req.target_per_rank[0].session_id).session_id
        for target in req.target_per_rank:
            self.peers.check(target.session_id)
            check_target(mine[min(target.tp, len(mine) - 1)], target)
            if slots_to_pages(target.kv_indices, self.page_size).numel() != (stop - start) // self.page_size:
                raise MigrationError(f"{len(target.kv_indices)} kv_indices for extra_token_size {stop - start}")
        if stop == start:
            return TransferRequestKVCacheResp(transport=self.endpoints[0].transport_name)
        with self.worker_lock:
            exported = self.worker.export_request_kv(tokens=req.input_ids[:stop], extra_key=req.extra_key, lock=True)
        try:
            t0 = time.perf_counter()
            staged = self._stage(exported.pages, start, stop, peer)
            stage_seconds = time.perf_counter() - t0
            try:
                done = self._send(mine, req, staged)
            finally:
                self._unstage(staged, peer, (stop - start) // self.page_size)
        finally:
            with self.worker_lock:
                self._unlock(exported)
        return TransferRequestKVCacheResp(
            bytes=sum(d.bytes for d in done),
            seconds=max(d.seconds for d in done),
            transport=done[0].transport,
            stage_seconds=stage_seconds,
        )

    def _send(
        self, mine: list[RankSession], req: TransferRequestKVCacheReq, staged: list[torch.Tensor]
    ) -> list[PullKVResp]:
        """Let the targets read ``staged`` (only those pages, only until they answered) and ask every target rank
        to pull; the ranks pull at once."""
        version = self.worker.weight_version
        checksum = pages_digest([(e.outbox.buffers(), p) for e, p in zip(self.endpoints, staged, strict=True)])
        offers = [e.offer(s.session_id, version, p) for e, s, p in zip(self.endpoints, mine, staged, strict=True)]
        try:
            sources = [
                PullSource(tp=s.tp, pp=s.pp, src_pages=p.tolist(), endpoint=o)
                for s, p, o in zip(mine, staged, offers, strict=True)
            ]
            pulls = [(t.session_id, self._pull_body(req, t, sources, checksum)) for t in req.target_per_rank]
            if len(pulls) == 1:
                return [self.send_pull(*pulls[0])]
            with ThreadPoolExecutor(max_workers=len(pulls), thread_name_prefix="kvmove-pull") as pool:
                return list(pool.map(lambda p: self.send_pull(*p), pulls))
        finally:
            for endpoint, offer in zip(self.endpoints, offers, strict=True):
                endpoint.withdraw(offer)

    @staticmethod
    def _pull_body(
        req: TransferRequestKVCacheReq, target: TransferTarget, sources: list[PullSource], checksum: str
    ) -> PullKVReq:
        return PullKVReq(
            checksum=checksum,
            input_ids=req.input_ids[: req.matched_token_size + req.extra_token_size],
            extra_key=req.extra_key,
            matched_token_size=req.matched_token_size,
            kv_indices=target.kv_indices,
            tp=target.tp,
            pp=target.pp,
            sources=sources,
        )

    def _window(self, req: TransferRequestKVCacheReq) -> Window:
        start, extra = req.matched_token_size, req.extra_token_size
        if start < 0 or extra < 0 or start % self.page_size or extra % self.page_size:
            raise MigrationError(f"matched/extra token sizes {start}/{extra} are not whole pages of {self.page_size}")
        if start + extra > len(req.input_ids):
            raise MigrationError(f"matched + extra = {start + extra} > {len(req.input_ids)} input_ids")
        return Window(start, start + extra)

    def _stage(self, pages: torch.Tensor, start: int, stop: int, peer: str) -> list[torch.Tensor]:
        """Every rank's copy of ``pages[start / page : stop / page]`` in its outbox (all ranks or none), within the
        shares of the transfers to ``peer``."""
        need = stop // self.page_size
        if pages.numel() < need:
            raise MigrationError(f"source missing pages: have {pages.numel()}, need {need} (possibly evicted)")
        send = pages[start // self.page_size : need]
        with self._count_lock:
            held = self._staged_for.get(peer, 0)
            self.share.check(send.numel(), held, self.endpoints[0].outbox.num_pages, peer, "outbox")
            self._staged_for[peer] = held + send.numel()
        staged: list[torch.Tensor] = []
        try:
            for r, (endpoint, pool) in enumerate(zip(self.endpoints, self.worker.pools, strict=True)):
                host = endpoint.stage(send.numel())
                if host is None:
                    raise OutOfPagesError(f"source outbox of rank {r} has no room to stage {send.numel()} pages")
                staged.append(host)
                endpoint.outbox.write_back(pool, send, host)
        except BaseException:
            self._unstage(staged, peer, send.numel())
            raise
        return staged

    def _unstage(self, staged: list[torch.Tensor], peer: str, pages: int) -> None:
        """Scrub and free every rank's ``staged`` pages; ``pages`` (one rank's count) no longer count for ``peer``."""
        for endpoint, host in zip(self.endpoints, staged, strict=False):
            endpoint.unstage(host)
        with self._count_lock:
            left = self._staged_for[peer] - pages
            if left:
                self._staged_for[peer] = left
            else:
                del self._staged_for[peer]

    def _unlock(self, exported: ExportedKV) -> None:
        if exported.node is not None:
            self.worker.unlock_export(exported)
