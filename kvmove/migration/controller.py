"""The migration controller: runs the allocate -> transfer -> commit protocol between two servers for one request,
with the request hand-over around it (hold on the source; release after the target committed, upon which the
source has the target continue the request and relays its answer to the request's client, or resumes it itself if
the target gives none). ``move_kv`` is the protocol alone: cached K/V to another worker, no request.

``migrate_request`` is the three-line loop of the protocol; every failure after an allocation aborts it on the
target and gives the request back to the source, so each request has exactly one owner and nothing leaks.

``migrate_request_sglang`` drives workers that speak only the SGLang fork's routes (its five migration routes,
``/abort_request`` and ``/generate``): the request is aborted on the source (its client receives what it generated
so far, its K/V stays cached there), the K/V the source caches for its tokens moves, and the request is re-submitted
to the target, whose prefix cache now holds it. There is no migration abort among those routes: a failed move is
left to the target's watchdog, and the request is re-submitted anyway (the target computes what did not move).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmove.migration import messages as m
from kvmove.migration.client import WorkerClient
from kvmove.migration.errors import MigrationError
from kvmove.migration.session import check_peers
from kvmove.server.messages import GenerateReq, GenerateResp, HoldRequestResp, ResumeInfo, ResumeState


@dataclass
class Migration:
    """One executed migration; ``phases`` are wall seconds seen by the controller (HTTP round trips included), plus
    ``source_stage`` (device -> host on the source) and ``target_load`` (host -> device on the target) as the
    servers measured them."""

    rid: str
    source: str
    target: str
    routes: str = "kvmove"
    tokens: list[int] = field(default_factory=list)  # whose K/V was to move (the request's tokens so far)
    migration_id: str = ""
    matched_tokens: int = 0
    extra_tokens: int = 0
    bytes: int = 0
    transport: str = ""
    transport_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    held: HoldRequestResp | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def seconds(self) -> float:
        """Allocate (with handshake and size query) + transfer + commit: the protocol itself."""
        return sum(self.phases.get(k, 0.0) for k in ("handshake", "allocate", "transfer", "commit"))

    @property
    def gbps(self) -> float:
        return self.bytes / self.transport_seconds / 1e9 if self.transport_seconds > 0 else 0.0


class _Clock:
    def __init__(self, phases: dict[str, float]) -> None:
        self.phases, self.t = phases, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.t
        self.t = now


def migrate_request(src: WorkerClient, dst: WorkerClient, rid: str) -> Migration:
    """Move waiting or running request ``rid`` and its cached K/V from ``src`` to ``dst``; ``src`` then has ``dst``
    continue it (``resume_body``) and relays the answer to the request's client."""
    rec = Migration(rid, src.url, dst.url)
    clock = _Clock(rec.phases)
    rec.held = held = src.hold(rid)
    rec.tokens = held.request.prompt_ids + held.request.output_ids
    clock.lap("hold")
    try:
        mid = _transfer(src, dst, held.input_ids, held.request.extra_key, rec, clock)
    except MigrationError as exc:
        src.release(rid, migrated=False)
        rec.error = str(exc)
        return rec
    src.release(rid, migrated=True, target=dst.url)
    clock.lap("release")
    rec.migration_id = mid
    return rec


def move_kv(src: WorkerClient, dst: WorkerClient, ids: list[int], extra_key: str | None = None) -> Migration:
    """Move the K/V ``src`` caches for the whole pages of ``ids`` under ``extra_key`` to ``dst`` (only the pages
    ``dst`` lacks), without any request: allocate -> transfer -> commit, aborted on the target if it fails."""
    rec = Migration("", src.url, dst.url, tokens=list(ids))
    try:
        rec.migration_id = _transfer(src, dst, ids, extra_key, rec, _Clock(rec.phases))
    except MigrationError as exc:
        rec.error = str(exc)
    return rec


class Moved(NamedTuple):
    """A move over the fork's routes: its record, and the body re-submitting the request to the target (None: it
    had finished before the abort)."""

    migration: Migration
    resubmit: GenerateReq | None


def migrate_request_sglang(
    src: WorkerClient, dst: WorkerClient, submitted: GenerateReq, answer: Callable[[], GenerateResp]
) -> Moved:
    """Move request ``submitted`` (sent to ``src`` by this client; ``answer()`` waits for its ``/generate`` answer)
    with the fork's routes only. Returns the record and the body re-submitting it to ``dst`` (None if it had
    finished before the abort); its output is the aborted answer's tokens followed by the re-submitted request's.
    Greedy continuation is exact; a sampled one restarts its generator there (the fork's routes carry no sampler)."""
    rid, key, prompt = submitted.rid or "", submitted.extra_key, submitted.input_ids
    if prompt is None or not rid:
        raise MigrationError("a request moved over the fork's routes needs its rid and input_ids")
    rec = Migration(rid, src.url, dst.url, routes="sglang")
    clock = _Clock(rec.phases)
    src.abort_request(rid)
    partial = answer()
    clock.lap("hold")
    if (partial.meta_info.get("finish_reason") or {}).get("type") != "abort":
        rec.error = "the request finished before it was aborted: nothing to move"
        return Moved(rec, None)
    rec.tokens = tokens = list(prompt) + list(partial.output_ids)
    try:
        cached = src.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=tokens, extra_key=key))
        if cached.matched_token_size:  # NOTE: what the source still caches of them (it may have evicted some)
            ids = tokens[: cached.matched_token_size]
            rec.migration_id = _transfer(src, dst, ids, key, rec, clock, abort_route=False)
    except MigrationError as exc:
        rec.error = str(exc)
    params = submitted.sampling_params
    left = params.model_copy(update={"max_new_tokens": params.max_new_tokens - len(partial.output_ids)})
    return Moved(rec, submitted.model_copy(update={"input_ids": tokens, "text": None, "sampling_params": left}))


def _transfer(
    src: WorkerClient,
    dst: WorkerClient,
    ids: list[int],
    key: str | None,
    rec: Migration,
    clock: _Clock,
    abort_route: bool = True,
) -> str:
    theirs, mine = dst.session_ids(), src.session_ids()
    if abort_route or all(r.geometry is not None for r in (*mine.ranks, *theirs.ranks)):
        check_peers(mine.ranks, theirs.ranks)  # NOTE: an SGLang fork's session info has no geometry to check
    size = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    clock.lap("handshake")
    alloc = dst.allocate(
        m.AllocateTokenForTransferReq(input_ids=ids, extra_key=key, extra_token_size=size.extra_token_size)
    )
    clock.lap("allocate")
    rec.matched_tokens, rec.extra_tokens = size.matched_token_size, size.extra_token_size
    try:
        done = src.transfer(transfer_body(ids, key, size, theirs, alloc))
        clock.lap("transfer")
        committed = dst.commit(alloc.migration_id)
        clock.lap("commit")
        rec.phases.update(source_stage=done.stage_seconds, target_load=committed.load_seconds)
    except MigrationError:
        if abort_route:
            _abort_quietly(dst, alloc.migration_id)
        raise
    rec.bytes, rec.transport, rec.transport_seconds = done.bytes, done.transport, done.seconds
    return alloc.migration_id


def transfer_body(
    ids: list[int],
    extra_key: str | None,
    size: m.GetRequestExtraTokenSizeResp,
    sessions: m.TransferSessionIds,
    alloc: m.AllocateTokenForTransferResp,
) -> m.TransferRequestKVCacheReq:
    """The source's body: the target's ranks joined with their allocated ``kv_indices`` on ``(tp, pp)``."""
    indices = {(r.tp, r.pp): r.kv_indices for r in alloc.per_rank_kv_indices}
    targets = [
        m.TransferTarget(
            **r.model_dump(include={"tp", "pp", "session_id", "host_kv_data_ptrs", "host_kv_item_lens", "transport"}),
            geometry=r.geometry,
            kv_indices=indices[(r.tp, r.pp)],
        )
        for r in sessions.ranks
        if (r.tp, r.pp) in indices
    ]
    return m.TransferRequestKVCacheReq(
        input_ids=ids,
        extra_key=extra_key,
        matched_token_size=size.matched_token_size,
        extra_token_size=size.extra_token_size,
        target_per_rank=targets,
    )


def resume_body(held: HoldRequestResp | ResumeState) -> GenerateReq:
    """The ``/generate`` body that continues a held request on its new worker."""
    r = held.request if isinstance(held, HoldRequestResp) else held
    return GenerateReq(
        input_ids=r.prompt_ids,
        rid=r.rid,
        sampling_params=r.sampling_params,
        priority=r.priority,
        extra_key=r.extra_key,
        resume=ResumeInfo(output_ids=r.output_ids, generator_state=r.generator_state),
    )


def _abort_quietly(dst: WorkerClient, migration_id: str) -> None:
    """Best effort: if the target is gone too, its watchdog releases the migration."""
    with contextlib.suppress(MigrationError):
        dst.abort(migration_id)
