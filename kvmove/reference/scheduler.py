"""Scheduler: priority queues of waiting requests, the running set, and admission under a bounded KV budget.

Admission is strict by priority (higher first, FIFO within one priority): if the head of the queue does not fit in
the KV pool, nothing behind it is admitted either, so a high-priority request waits for pages rather than being
overtaken. A request is admitted only with pages for all the K/V it can ever need (no preemption, no OOM later).
Every step runs all running requests: the newly admitted ones prefill while the others decode, in one batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvmove.reference.kv_manager import KVAllocation, KVManager
from kvmove.reference.request import FinishReason, Request, RequestState, UnknownRequestError


@dataclass(frozen=True)
class ScheduledBatch:
    """Requests of one step: ``prefill`` compute their uncached tokens, ``decode`` their last sampled one."""

    prefill: tuple[Request, ...]
    decode: tuple[Request, ...]

    @property
    def requests(self) -> tuple[Request, ...]:
        return self.prefill + self.decode

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


@dataclass
class Scheduler:
    kv: KVManager
    max_running: int = 16
    max_prefill_tokens: int = 1024
    waiting: dict[int, deque[Request]] = field(default_factory=dict)
    running: dict[str, Request] = field(default_factory=dict)
    allocs: dict[str, KVAllocation] = field(default_factory=dict)

    def add(self, req: Request) -> None:
        req.state = RequestState.WAITING
        self.waiting.setdefault(req.priority, deque()).append(req)

    def get(self, rid: str) -> Request | None:
        if rid in self.running:
            return self.running[rid]
        return next((r for q in self.waiting.values() for r in q if r.rid == rid), None)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def queue_lengths(self) -> dict[int, int]:
        """Waiting requests per priority, highest priority first."""
        return {p: len(self.waiting[p]) for p in sorted(self.waiting, reverse=True) if self.waiting[p]}

    def schedule(self) -> ScheduledBatch:
        decode = tuple(self.running.values())
        prefill: list[Request] = []
        budget = self.max_prefill_tokens
        while len(self.running) < self.max_running:
            req = self._head()
            if req is None:
                break
            m = self.kv.match(req.all_ids, req.extra_key, req.max_kv_tokens)
            new_tokens = req.num_tokens - m.cached_tokens
            if not self.kv.can_admit(m) or (prefill and new_tokens > budget):
                break
            self.waiting[req.priority].popleft()
            self.allocs[req.rid] = self.kv.admit(m)
            req.state, req.cached_tokens, req.kv_len = RequestState.RUNNING, m.cached_tokens, m.cached_tokens
            self.running[req.rid] = req
            prefill.append(req)
            budget -= new_tokens
        return ScheduledBatch(tuple(prefill), decode)

    def postprocess(self, batch: ScheduledBatch, tokens: dict[str, int]) -> list[Request]:
        """Append each request's sampled token; finish (and release) those that stop. Returns the finished.

        Requests of ``batch`` without a token (they failed) must have been finished by ``fail`` already."""
        finished = []
        for req in batch.requests:
            if req.rid not in tokens:
                continue
            token = tokens[req.rid]
            req.output_ids.append(token)
            if token in req.sampling.stop_token_ids:
                req.finish_reason = FinishReason.STOP
            elif req.remaining_new_tokens <= 0:
                req.finish_reason = FinishReason.LENGTH
            if req.finish_reason is not None:
                self._release(req, RequestState.FINISHED)
                finished.append(req)
        return finished

    def abort(self, rid: str) -> Request:
        """Remove a waiting or running request; a running one's computed whole pages stay cached."""
        req = self.get(rid)
        if req is None:
            raise UnknownRequestError(f"no waiting or running request with rid {rid!r}")
        req.finish_reason = FinishReason.ABORT
        if req.state is RequestState.WAITING:
            self.waiting[req.priority].remove(req)
            req.state = RequestState.ABORTED
        else:
            self._release(req, RequestState.ABORTED)
        return req

    def fail(self, rid: str, error: str) -> Request:
        """Finish running request ``rid`` with ``FinishReason.ERROR``; its K/V computed so far stays cached."""
        req = self.running[rid]
        req.finish_reason, req.error = FinishReason.ERROR, error
        self._release(req, RequestState.FINISHED)
        return req

    def _release(self, req: Request, state: RequestState) -> None:
        del self.running[req.rid]
        self.kv.release(self.allocs.pop(req.rid), req.all_ids[: req.kv_len], req.extra_key)
        req.state = state

    def _head(self) -> Request | None:
        for p in sorted(self.waiting, reverse=True):
            if self.waiting[p]:
                return self.waiting[p][0]
        return None
