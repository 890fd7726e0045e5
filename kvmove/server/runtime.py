"""A server's runtime: the rollout worker stepped by a background thread, generation futures, request hand-over,
and (with ``enable_kv_migration``) the migration plane: every rank's host endpoint, the target, source, watchdog.

Locks: ``lock`` guards the worker and the request tables and is held by each step of the decode loop; the
migration target's table lock is always taken before it (never after). No byte of a migration moves under
either, so generation keeps stepping while a migration pulls pages (``kvmove.migration.target``).
A request that raises while the worker steps it fails alone (``RequestFailedError``); its batch runs on. Requests
held for migration live in ``held`` (``kvmove.server.handover``) until they resume here or their target answered.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

import torch

from kvmove.migration.endpoint import HostEndpoint
from kvmove.migration.errors import MigrationConflictError, MigrationDisabledError
from kvmove.migration.fields import SAMPLING_EPS
from kvmove.migration.messages import RankSession, TransferSessionIds
from kvmove.migration.source import MigrationSource
from kvmove.migration.target import MigrationTarget
from kvmove.migration.watchdog import Watchdog
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import (
    Request,
    RequestError,
    RequestFailedError,
    RolloutWorker,
    SamplingParams,
    WorkerConfig,
)
from kvmove.server.config import ServerConfig
from kvmove.server.handover import HeldRequests
from kvmove.server.messages import (
    AbortRequestReq,
    FlushCacheResp,
    GenerateReq,
    GenerateResp,
    Integrity,
    Metrics,
    Resources,
)
from kvmove.server.plane import MigrationPlane
from kvmove.server.requests import InFlight, Outcome, Submitted, abort_reason, finish_reason, generator, wait_for_answer
from kvmove.server.resources import check_server_memory, process_resources
from kvmove.server.steps import StepLog, StepRecord
from kvmove.server.tokenizer import ByteTokenizer
from kvmove.transport.http_route import ReadAnswer


class Runtime:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        check_server_memory(config)  # NOTE: before anything is allocated
        model = resolve_model(config.model)
        dtype = getattr(torch, config.dtype)
        worker_config = WorkerConfig(
            config.num_pages,
            config.page_size,
            config.max_running,
            config.max_prefill_tokens,
            dtype,
            config.weight_version,
            config.tp_size,
        )
        self.worker = RolloutWorker(model, seeded_checkpoint(model, config.seed).items(), worker_config)
        self.tokenizer = ByteTokenizer(model.vocab_size)
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self._inflight: dict[str, InFlight] = {}
        self.held = HeldRequests(self.worker, self._wake, self._inflight, config, self._aborted_answer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvmove-worker-{config.port}", daemon=True)
        self.steps = StepLog()
        self.plane = MigrationPlane(config, self.worker, self.lock) if config.enable_kv_migration else None
        self._target: MigrationTarget | None = self.plane.target if self.plane else None
        self._source: MigrationSource | None = self.plane.source if self.plane else None
        self.watchdog: Watchdog | None = self.plane.watchdog if self.plane else None

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.plane is not None:
            self.plane.close()

    @property
    def endpoint(self) -> HostEndpoint | None:
        """Rank 0's host endpoint (None without migration)."""
        return self.plane.endpoint if self.plane else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                if self.worker.is_idle:
                    self._wake.wait(timeout=min(0.05, self.config.watchdog_interval))
                else:
                    self._step()
            if self.watchdog is not None:
                self.watchdog.tick()
            if self.held.held:
                self.held.expire()
            time.sleep(0)  # NOTE: let a thread waiting for the lock (hold, release, a migration) have it between steps

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            out = self.worker.step()
        except Exception as exc:  # NOTE: a bug in a step must not hang every client
            for rid in list(self.worker.scheduler.running):
                self.worker.abort(rid)
                self._inflight.pop(rid).future.set_exception(exc)
            return
        now = time.perf_counter()
        self.steps.record(StepRecord(now, now - start, out.decode_tokens, out.prefill_tokens))
        for req in out.failed:
            failed = self._inflight.pop(req.rid, None)
            if failed is not None:
                failed.future.set_exception(RequestFailedError(f"request {req.rid!r} failed: {req.error}"))
        for rid in out.new_tokens:
            pending = self._inflight.get(rid)
            if pending is not None and pending.first_token_at is None:
                pending.first_token_at = now
            if pending is not None and pending.on_tokens is not None and (running := self.worker.scheduler.get(rid)):
                pending.on_tokens(list(running.output_ids))
        for req in out.finished:
            pending = self._inflight.pop(req.rid, None)
            if pending is not None:
                pending.future.set_result(self._response(req, pending))

    # -- generation ----------------------------------------------------------------------------------------------

    async def generate(self, body: GenerateReq, gone: Callable[[], Awaitable[object]] | None = None) -> GenerateResp:
        """Run ``body`` to its answer. If ``gone()`` completes first (its client disconnected) or its deadline passes
        (``body.timeout``, else the server's ``request_timeout``), the request is aborted wherever it is (waiting,
        running, held, or continued on a migration target): its pages and locks are released at once, and the
        answer is what it generated so far, finish reason abort (a client that left gets no answer at all)."""
        rid, future, timeout = self.submit(body)
        answer = asyncio.wrap_future(future)
        outcome = await wait_for_answer(answer, gone() if gone else None, timeout)
        if outcome is Outcome.ANSWERED:
            return answer.result()
        message = "client disconnected" if outcome is Outcome.GONE else f"deadline of {timeout:g} s exceeded"
        self.abandon(rid, f"{message} (rid {rid})")
        if outcome is Outcome.GONE:
            return GenerateResp(text="", output_ids=[], meta_info={"id": rid, "finish_reason": abort_reason(message)})
        return await asyncio.shield(answer)

    def submit(self, body: GenerateReq, on_tokens: Callable[[list[int]], None] | None = None) -> Submitted:
        """Hand ``body`` to the worker; ``on_tokens(output_ids)`` is called (on the worker's thread) after every step
        that gave it a token, but the last (its answer)."""
        req = self._request(body)
        future: Future[GenerateResp] = Future()
        timeout = body.timeout or self.config.request_timeout or None
        with self._wake:
            if req.rid in self._inflight or req.rid in self.held.held:
                raise RequestError(f"request {req.rid!r} is already waiting, running or held")
            self.worker.submit(req)
            deadline = None if timeout is None else time.monotonic() + timeout
            self._inflight[req.rid] = InFlight(future, deadline=deadline, on_tokens=on_tokens)
            self._wake.notify()
        return Submitted(req.rid, future, timeout)

    def abandon(self, rid: str, message: str) -> None:
        """Abort ``rid`` whose caller stopped waiting, wherever it is: waiting or running (its pages back to the pool,
        its computed whole pages cached, unlocked), held (its pin released) or continued on a target (asked to abort
        there). Its future gets the abort answer. Nothing if it already finished."""
        with self._wake:
            pending = self._inflight.get(rid)
            if pending is None or self.worker.scheduler.get(rid) is None:
                self.held.abandon(rid, message)
                return
            req = self.worker.abort(rid)
            del self._inflight[rid]
        pending.future.set_result(self._response(req, pending, finish_reason=abort_reason(message)))

    def _request(self, body: GenerateReq) -> Request:
        if (body.text is None) == (body.input_ids is None):
            raise RequestError("pass exactly one of text or input_ids")
        sp = body.sampling_params
        if sp.top_p != 1.0 or sp.top_k not in (-1, 0):
            raise RequestError("only top_p=1 and top_k=-1 are supported (greedy or plain temperature sampling)")
        temperature = sp.temperature if sp.temperature >= SAMPLING_EPS else 0.0  # NOTE: SGLang's greedy rule
        params = SamplingParams(sp.max_new_tokens, temperature, sp.sampling_seed or 0, tuple(sp.stop_token_ids or ()))
        ids = body.input_ids if body.input_ids is not None else self.tokenizer.encode(body.text or "")
        resume = body.resume
        return Request(
            rid=body.rid or uuid.uuid4().hex,
            prompt_ids=ids,
            sampling=params,
            priority=body.priority or 0,
            extra_key=body.extra_key,
            output_ids=resume.output_ids if resume else [],
            generator=generator(resume.generator_state) if resume and resume.generator_state else None,
        )

    def _aborted_answer(self, req: Request, pending: InFlight, message: str) -> GenerateResp:
        return self._response(req, pending, finish_reason=abort_reason(message))

    def _response(self, req: Request, pending: InFlight, **extra: object) -> GenerateResp:
        now = time.perf_counter()
        reason = extra.pop("finish_reason", None) or finish_reason(req)
        first = pending.first_token_at
        meta = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "weight_version": self.worker.weight_version,
            "total_retractions": 0,
            "reasoning_tokens": 0,
            "e2e_latency": now - pending.submitted_at,
            "first_token_seconds": None if first is None else first - pending.submitted_at,
            **extra,
        }
        return GenerateResp(text=self.tokenizer.decode(req.output_ids), output_ids=req.output_ids, meta_info=meta)

    # -- requests ------------------------------------------------------------------------------------------------------

    def abort_request(self, body: AbortRequestReq) -> None:
        """SGLang's ``/abort_request``: end waiting or running ``rid`` (or all) now; its client gets what it has
        generated so far with finish reason abort, and its computed whole pages stay cached."""
        with self._wake:
            rids = list(self._inflight) if body.abort_all else [body.rid]
            aborted = []
            for rid in rids:
                if rid in self._inflight and self.worker.scheduler.get(rid) is not None:
                    aborted.append((self.worker.abort(rid), self._inflight.pop(rid)))
        message = body.abort_message or "aborted by /abort_request"
        for req, inflight in aborted:
            inflight.future.set_result(self._response(req, inflight, finish_reason=abort_reason(message)))

    # -- migration -------------------------------------------------------------------------------------------------

    @property
    def target(self) -> MigrationTarget:
        if self._target is None:
            raise MigrationDisabledError("kv migration not enabled (start the server with --enable-kv-migration)")
        return self._target

    @property
    def source(self) -> MigrationSource:
        if self._source is None:
            raise MigrationDisabledError("kv migration not enabled (start the server with --enable-kv-migration)")
        return self._source

    def rank_session(self) -> RankSession:
        """Rank 0's session entry."""
        return self._plane().rank_sessions()[0]

    def session_ids(self) -> TransferSessionIds:
        return self._plane().session_ids()

    def read_pages(self, body: bytes) -> ReadAnswer:
        """A peer's read of host pages a rank of this server offered it (the ``http`` data plane)."""
        return self._plane().read_pages(body)

    def _plane(self) -> MigrationPlane:
        if self.plane is None:
            raise MigrationDisabledError("kv migration not enabled (start the server with --enable-kv-migration)")
        return self.plane

    # -- metrics, invariants -----------------------------------------------------------------------------------------

    def metrics(self, include_rids: bool = True) -> Metrics:
        """Counters of the worker and its migrations; request ids only if ``include_rids`` (an admin caller)."""
        with self.lock:
            s = self.worker.stats()
            waiting = self.worker.scheduler.waiting if include_rids else {}
            return Metrics(
                waiting_per_priority={str(p): n for p, n in s.waiting_per_priority.items()},
                waiting_rids={str(p): [r.rid for r in q] for p, q in sorted(waiting.items(), reverse=True) if q},
                running=s.running,
                running_rids=list(self.worker.scheduler.running) if include_rids else [],
                held_rids=list(self.held.held) if include_rids else [],
                rids_hidden=not include_rids,
                free_pages=s.free_pages,
                used_pages=s.used_pages,
                cached_pages=s.cached_pages,
                total_pages=s.total_pages,
                page_size=self.config.page_size,
                host_free_pages=self.plane.host_free_pages if self.plane else 0,
                migrations_pending=len(self._target.pending) if self._target else 0,
                weight_version=s.weight_version,
                transport=self.endpoint.choice.name if self.endpoint else "",
                transport_note=self.endpoint.choice.note if self.endpoint else "",
            )

    def resources(self) -> Resources:
        """What this server holds now (process, pools, locks, migrations); what a soak compares over time."""
        proc, plane = process_resources(), self.plane
        with self.lock:
            return Resources(
                fds=proc.fds,
                rss_bytes=proc.rss_bytes,
                threads=proc.threads,
                device_used_pages=self.worker.pool.used_pages,
                device_locked_pages=self.worker.kv.tree.protected_pages,
                export_locks=self.worker.kv.export_locks,
                host_used_pages=plane.host_used_pages if plane else 0,
                outbox_used_pages=plane.staged_pages if plane else 0,
                migrations_pending=len(plane.target.pending) if plane else 0,
                held_requests=len(self.held.held),
                inflight_requests=len(self._inflight),
                open_grants=plane.open_grants if plane else 0,
            )

    def integrity(self) -> Integrity:
        try:
            self.check_integrity()
        except Exception as exc:
            return Integrity(ok=False, message=str(exc))
        return Integrity(ok=True)

    def check_integrity(self) -> None:
        """Worker invariants (every rank); each rank's host pages used == its migrations' + staged; no lock
        without a holder; no read grant without a transfer in flight."""
        if self.plane is None:
            with self.lock:
                self.worker.check_integrity()
            return
        with self.plane.target.locked(), self.lock:
            self.worker.check_integrity()
            self.plane.check_owned()

    def flush_cache(self) -> FlushCacheResp:
        with self.lock:
            if not self.worker.is_idle or self.held.held or (self._target and self._target.pending):
                raise MigrationConflictError("cannot flush the cache while requests or migrations are in flight")
            return FlushCacheResp(freed_pages=self.worker.flush_cache())
