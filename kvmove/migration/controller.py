"""The migration controller: runs the allocate -> transfer -> commit protocol between two servers for one request,
with the request hand-over around it (hold on the source, release after the target committed, resume there).

``migrate_request`` is the three-line loop of the protocol; every failure after an allocation aborts it on the
target and gives the request back to the source, so each request has exactly one owner and nothing leaks.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from kvmove.migration import messages as m
from kvmove.migration.client import WorkerClient
from kvmove.migration.errors import MigrationError
from kvmove.migration.session import check_peers


@dataclass
class Migration:
    """One executed migration; ``phases`` are wall seconds seen by the controller (HTTP round trips included), plus
    ``source_stage`` (device -> host on the source) and ``target_load`` (host -> device on the target) as the
    servers measured them."""

    rid: str
    source: str
    target: str
    migration_id: str = ""
    matched_tokens: int = 0
    extra_tokens: int = 0
    bytes: int = 0
    transport: str = ""
    transport_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    held: m.HoldRequestResp | None = None
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
    """Move waiting or running request ``rid`` and its cached K/V from ``src`` to ``dst``; the request is then
    released by ``src`` and must be resumed on ``dst`` with ``resume_body(record)``."""
    rec = Migration(rid, src.url, dst.url)
    clock = _Clock(rec.phases)
    rec.held = held = src.hold(rid)
    clock.lap("hold")
    try:
        mid = _transfer(src, dst, held, rec, clock)
    except MigrationError as exc:
        src.release(rid, migrated=False)
        rec.error = str(exc)
        return rec
    src.release(rid, migrated=True, target=dst.url)
    clock.lap("release")
    rec.migration_id = mid
    return rec


def _transfer(src: WorkerClient, dst: WorkerClient, held: m.HoldRequestResp, rec: Migration, clock: _Clock) -> str:
    ids, key = held.input_ids, held.request.extra_key
    theirs, mine = dst.session_ids(), src.session_ids()
    check_peers(mine.ranks, theirs.ranks)
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


def resume_body(held: m.HoldRequestResp) -> m.GenerateReq:
    """The ``/generate`` body that continues a held request on its new worker."""
    r = held.request
    return m.GenerateReq(
        input_ids=r.prompt_ids,
        rid=r.rid,
        sampling_params=r.sampling_params,
        priority=r.priority,
        extra_key=r.extra_key,
        resume=m.ResumeInfo(output_ids=r.output_ids, generator_state=r.generator_state),
    )


def _abort_quietly(dst: WorkerClient, migration_id: str) -> None:
    """Best effort: if the target is gone too, its watchdog releases the migration."""
    with contextlib.suppress(MigrationError):
        dst.abort(migration_id)
