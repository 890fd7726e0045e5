"""Hand-over of a migrated request, with nothing lost: the source relays the target's answer to its own client.

After ``release(migrated=true)`` the source keeps the request's resume state (tokens so far, sampling state) and
asks the target to continue it (``/generate`` with the resume body, the peer key attached). The target's answer
is what the source's client receives (``meta_info.migrated_to`` names the target). If the target cannot be reached,
refuses the request, dies before answering or does not answer within the hand-over timeout, the request resumes on
the source from the state it kept, token for token as it would have continued (greedy, or seeded sampling with
the generator state carried along). Only the death of the source, the worker its client is connected to, can lose
the request. A request whose client leaves (or whose deadline passes) while held is let go; while it runs on its
target, the target is asked to abort it (``/abort_request``), so neither worker keeps computing for nobody.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import resume_body
from kvmove.migration.errors import MigrationConflictError, MigrationError
from kvmove.migration.peers import PeerAddress, PeerPolicy
from kvmove.reference import ExportedKV, Request, RequestError, RolloutWorker, UnknownRequestError
from kvmove.server.config import ServerConfig
from kvmove.server.messages import (
    GenerateResp,
    HoldRequestReq,
    HoldRequestResp,
    ReleaseRequestReq,
    ReleaseRequestResp,
    ResumeState,
)
from kvmove.server.requests import InFlight, resume_state

log = logging.getLogger("kvmove.server")


AbortedAnswer = Callable[[Request, InFlight, str], GenerateResp]


class HandOverResult(NamedTuple):
    """The target's answer (None if it gave none), and why the request resumes here instead ("" if it did not)."""

    answer: GenerateResp | None
    failure: str = ""


def handover_peer(target: str, peers: PeerPolicy) -> PeerAddress:
    """The validated address of a release's ``target``: ``host:port`` or ``http://host:port`` (nothing more)."""
    return peers.check(target.removeprefix("http://").rstrip("/"))


def continue_on(
    peer: PeerAddress, state: ResumeState, key: str | None, timeout_s: float, deadline_s: float | None = None
) -> HandOverResult:
    """Have ``peer`` continue the request of ``state`` (within ``deadline_s`` there, the rest of its own deadline);
    blocks until it answered or failed."""
    body = resume_body(state).model_copy(update={"timeout": deadline_s})
    try:
        with WorkerClient(peer.base_url, timeout=timeout_s, api_key=key) as client:
            answer = client.generate(body, timeout=timeout_s)
    except (MigrationError, ValueError) as exc:  # NOTE: ValueError: an answer that is not a GenerateResp
        return HandOverResult(None, str(exc))
    meta = {**answer.meta_info, "migrated_to": peer.base_url}
    return HandOverResult(answer.model_copy(update={"meta_info": meta}))


@dataclass
class Held:
    """A held request: ``exported`` pins its pages until released; ``forwarded_to`` the target continuing it."""

    request: Request
    exported: ExportedKV
    inflight: InFlight
    held_at: float = field(default_factory=time.monotonic)
    forwarded_to: str = ""
    abandoned: str = ""  # why its caller stopped waiting ("": it waits)


class HeldRequests:
    """The requests a worker holds for migration, from ``hold`` until they resume here or their target answered.

    Shares the worker, its lock (``wake``, notified when a request is put back) and the in-flight table with the
    runtime; every method takes the lock itself.
    """

    def __init__(
        self,
        worker: RolloutWorker,
        wake: threading.Condition,
        inflight: dict[str, InFlight],
        config: ServerConfig,
        aborted: AbortedAnswer,
    ) -> None:
        """``aborted(request, inflight, message)``: the answer of a request aborted with ``message``."""
        self.worker, self.wake, self.inflight, self.config, self.aborted = worker, wake, inflight, config, aborted
        self.held: dict[str, Held] = {}

    def hold(self, body: HoldRequestReq) -> HoldRequestResp:
        """Take ``rid`` out of the scheduler (its computed whole pages stay cached and locked); still owned here."""
        with self.wake:
            if body.rid in self.held:
                raise MigrationConflictError(f"request {body.rid!r} is already held")
            if body.rid not in self.inflight:
                raise UnknownRequestError(f"no waiting or running request with rid {body.rid!r}")
            req = self.worker.abort(body.rid).continuation()
            usable = (req.num_tokens - 1) // self.config.page_size * self.config.page_size
            exported = self.worker.export_request_kv(tokens=req.all_ids[:usable], extra_key=req.extra_key, lock=True)
            self.held[body.rid] = Held(req, exported, self.inflight.pop(body.rid))
        return HoldRequestResp(rid=body.rid, input_ids=list(exported.token_ids), request=resume_state(req))

    def release(self, body: ReleaseRequestReq) -> ReleaseRequestResp:
        """``migrated``: the target committed; it continues the request and this worker relays its answer to the
        client, or resumes the request here if the target gives none. Otherwise: resume here now."""
        peer = handover_peer(body.target, self.config.peers) if body.migrated else None
        with self.wake:
            held = self.held.get(body.rid)
            if held is None or held.forwarded_to:
                raise UnknownRequestError(f"request {body.rid!r} is not held")
            self._unpin(held)
            if peer is None:
                self._resume_here(body.rid, held)
            else:
                held.forwarded_to = peer.base_url
        if peer is not None:
            name = f"kvmove-handover-{body.rid[:16]}"
            threading.Thread(target=self._hand_over, args=(body.rid, held, peer), name=name, daemon=True).start()
        return ReleaseRequestResp(rid=body.rid, state="migrated" if body.migrated else "resumed")

    def expire(self) -> list[str]:
        """Resume here every request held longer than the hold timeout and never released (its controller died);
        returns their ids."""
        deadline = time.monotonic() - self.config.hold_timeout
        with self.wake:
            late = [rid for rid, h in self.held.items() if not h.forwarded_to and h.held_at < deadline]
            for rid in late:
                log.warning("request %s held longer than the hold timeout and never released; resuming it here", rid)
                held = self.held[rid]
                self._unpin(held)
                self._resume_here(rid, held)
        return late

    def abandon(self, rid: str, message: str) -> None:
        """``rid``'s caller stopped waiting (``message`` says why): a held request is let go now (its pages
        unpinned, its answer the abort); one continued on a target is aborted there, until the target answered."""
        with self.wake:
            held = self.held.get(rid)
            if held is None or held.abandoned:
                return
            held.abandoned = message
            if not held.forwarded_to:
                self._unpin(held)
                del self.held[rid]
        if not held.forwarded_to:
            held.inflight.future.set_result(self.aborted(held.request, held.inflight, message))
            return
        name = f"kvmove-abort-{rid[:16]}"
        threading.Thread(target=self._abort_on_target, args=(rid, held), name=name, daemon=True).start()

    def _abort_on_target(self, rid: str, held: Held) -> None:
        """Ask the target to abort ``rid`` until the hand-over ended (the target's ``/generate`` for it may not have
        arrived yet, when an abort finds nothing), at most for the hand-over timeout."""
        deadline = time.monotonic() + self.config.handover_timeout
        with WorkerClient(held.forwarded_to, timeout=5, api_key=self.config.keys.peer_key) as client:
            while self.held.get(rid) is held and time.monotonic() < deadline:
                try:
                    client.abort_request(rid)
                except MigrationError as exc:
                    log.warning("request %s: abort on %s failed: %s", rid, held.forwarded_to, exc)
                time.sleep(0.1)

    def _hand_over(self, rid: str, held: Held, peer: PeerAddress) -> None:
        state = resume_state(held.request)
        keys, left = self.config.keys, held.inflight.seconds_left()
        result = continue_on(peer, state, keys.peer_key, self.config.handover_timeout, left)
        with self.wake:
            if result.answer is None and not held.abandoned:
                log.warning("request %s: target %s gave no answer (%s); resuming it here", rid, peer, result.failure)
                self._resume_here(rid, held)
                return
            del self.held[rid]
        answer = result.answer or self.aborted(held.request, held.inflight, held.abandoned)
        held.inflight.future.set_result(answer)

    def _resume_here(self, rid: str, held: Held) -> None:
        del self.held[rid]
        try:
            self.worker.submit(held.request)
        except RequestError as exc:
            held.inflight.future.set_exception(exc)
            return
        self.inflight[rid] = held.inflight
        self.wake.notify()

    def _unpin(self, held: Held) -> None:
        if held.exported.node is not None:
            self.worker.unlock_export(held.exported)
            held.exported = held.exported._replace(node=None)
