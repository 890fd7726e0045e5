"""The migration protocol end to end between two real servers on loopback: exact continuation, prefix dedup,
abort, watchdog, dead peer, and that nothing leaks (integrity on both sides after every path). Tests that move
bytes run over every KV transport installed here (``transport``: nixl and the http fallback)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx
import torch
from server_fixtures import pause_after_decoding

from kvmove.migration import messages as m
from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import migrate_request, transfer_body
from kvmove.migration.errors import MigrationError, PeerMismatchError, PeerUnreachableError, UnknownMigrationError
from kvmove.migration.session import check_peer
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.server.messages import GenerateReq, GenerateResp, SamplingParamsMsg

PAGE_BYTES = 4 * 2 * 16 * 4  # page_size * kv heads * head_dim * float32, qwen3-tiny
BUFFERS = 8  # K and V of 4 layers


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(ids: list[int], n: int) -> list[int]:
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=4))
    w.submit(Request("ref", ids, SamplingParams(max_new_tokens=n)))
    return w.run_until_idle()[0].output_ids


def _clean(*servers) -> None:
    for s in servers:
        s.runtime.check_integrity()
        assert not s.runtime.target.pending
        assert s.runtime.endpoint.pool.used_pages == 0, "host pages leaked"
        assert s.runtime.endpoint.open_grants == 0, "a read grant outlived its transfer"


def _cache(c: WorkerClient, ids: list[int], key: str) -> None:
    body = GenerateReq(input_ids=ids, sampling_params=SamplingParamsMsg(max_new_tokens=1, temperature=0), extra_key=key)
    c.generate(body)


def test_migrated_request_continues_exactly_as_without_migration(pair_over, transport: str, monkeypatch) -> None:
    a, b = pair_over(transport)
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids = _ids(22, seed=1)
    rid = f"mig-exact-{transport}"
    body = GenerateReq(
        input_ids=ids,
        rid=rid,
        priority=5,
        extra_key="exact",
        sampling_params=SamplingParamsMsg(max_new_tokens=60, temperature=0),
    )
    out: dict[str, GenerateResp] = {}
    t = threading.Thread(target=lambda: out.setdefault("src", src.generate(body)))
    t.start()
    pause_after_decoding(monkeypatch, a, rid, tokens=3)  # NOTE: held mid-decode, never finished before the hold
    rec = migrate_request(src, dst, rid)
    assert rec.ok, rec.error
    assert rec.transport == transport
    t.join(timeout=30)
    done = out["src"]  # the source relays the target's answer to its own client
    assert done.meta_info["migrated_to"] == b.url and done.meta_info["finish_reason"]["type"] == "length"
    assert rec.held is not None and len(rec.held.request.output_ids) >= 3, "moved mid-decode"
    assert done.output_ids == _greedy(ids, 60)
    assert done.meta_info["cached_tokens"] == len(rec.held.input_ids) > 0, "resumed from migrated K/V, no recompute"
    assert rec.bytes == len(rec.held.input_ids) // 4 * PAGE_BYTES * BUFFERS
    _clean(a, b)


@pytest.mark.parametrize("warm_tokens", [0, 8])
def test_only_the_pages_the_target_lacks_are_sent(pair_over, transport: str, warm_tokens: int) -> None:
    a, b = pair_over(transport)
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    key, ids = f"dedup-{warm_tokens}-{transport}", _ids(20, seed=2)
    _cache(src, ids, key)  # 20 tokens of K/V: 5 pages
    if warm_tokens:
        _cache(dst, ids[:warm_tokens], key)  # the target has the first 2 pages
    size = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    assert (size.matched_token_size, size.extra_token_size, size.total_token_size) == (
        warm_tokens,
        20 - warm_tokens,
        20,
    )
    alloc = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key=key, extra_token_size=20 - warm_tokens))
    assert len(alloc.per_rank_kv_indices[0].kv_indices) == 20 - warm_tokens
    done = src.transfer(transfer_body(ids, key, size, dst.session_ids(), alloc))
    assert done.bytes == (20 - warm_tokens) // 4 * PAGE_BYTES * BUFFERS and done.transport == transport
    assert dst.commit(alloc.migration_id).matched_after_commit == 20
    after = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    assert after.matched_token_size == 20
    with pytest.raises(UnknownMigrationError, match="not found"):
        dst.commit(alloc.migration_id)  # already committed
    _clean(a, b)


def test_abort_releases_everything_and_unknown_ids_are_404(pair) -> None:
    a, b = pair
    dst = WorkerClient(b.url)
    ids = _ids(16, seed=3)
    alloc = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key="abort", extra_token_size=16))
    assert dst.metrics().migrations_pending == 1
    assert dst.abort(alloc.migration_id).released_pages == 4
    for call in (dst.abort, dst.commit):
        with pytest.raises(UnknownMigrationError):
            call(alloc.migration_id)
    _clean(a, b)


def test_watchdog_releases_an_uncommitted_migration(pair) -> None:
    a, b = pair
    dst = WorkerClient(b.url)
    _cache(dst, _ids(8, seed=4), "wd")
    ids = _ids(8, seed=4) + _ids(8, seed=5)
    alloc = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key="wd", extra_token_size=8))
    assert b.runtime.worker.kv.tree.protected_pages > 0, "matched prefix locked"
    deadline = time.monotonic() + 10
    while dst.metrics().migrations_pending:
        assert time.monotonic() < deadline, "watchdog never fired"
        time.sleep(0.05)
    assert alloc.migration_id in b.runtime.watchdog.expired
    with pytest.raises(UnknownMigrationError, match="not found"):
        dst.commit(alloc.migration_id)
    assert b.runtime.worker.kv.tree.protected_pages == 0
    _clean(a, b)


def test_dead_source_mid_migration_leaves_no_leak(start_server, pair_over, transport: str) -> None:
    _, b = pair_over(transport)
    a = start_server(transport=transport)
    src, dst = WorkerClient(a.url, timeout=5), WorkerClient(b.url)
    ids = _ids(12, seed=6)
    key = f"dead-{transport}"
    _cache(src, ids, key)
    size = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    alloc = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key=key, extra_token_size=12))
    body = transfer_body(ids, key, size, dst.session_ids(), alloc)
    a.stop()
    with pytest.raises(PeerUnreachableError):
        src.transfer(body)
    deadline = time.monotonic() + 10
    while dst.metrics().migrations_pending:  # nobody aborts: the watchdog releases it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _clean(b)


def test_pull_into_slots_not_allocated_for_a_migration_is_refused(pair) -> None:
    a, b = pair
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids = _ids(8, seed=7)
    _cache(src, ids, "forged")
    alloc = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key="forged", extra_token_size=8))
    size = m.GetRequestExtraTokenSizeResp(extra_token_size=8, matched_token_size=0, total_token_size=8)
    forged = alloc.model_copy(
        update={"per_rank_kv_indices": [m.RankKVIndices(tp=0, pp=0, kv_indices=list(range(40, 48)))]}
    )
    with pytest.raises(UnknownMigrationError, match="not allocated"):
        src.transfer(transfer_body(ids, "forged", size, dst.session_ids(), forged))
    partial = alloc.model_copy(update={"per_rank_kv_indices": [m.RankKVIndices(tp=0, pp=0, kv_indices=[1, 2, 3, 5])]})
    r = httpx.post(
        f"{a.url}/transfer_request_kvcache",
        json=transfer_body(ids, "forged", size, dst.session_ids(), partial).model_dump(),
    )
    assert r.status_code == 400 and "page-aligned" in r.json()["message"]
    dst.abort(alloc.migration_id)
    _clean(a, b)


@pytest.mark.parametrize("mismatch", [{"page_size": 8}, {"dtype": "bfloat16"}, {"weight_version": "7"}])
def test_mismatched_peers_are_refused_before_anything_moves(start_server, pair, mismatch: dict) -> None:
    a, b = pair
    other = start_server(**mismatch)
    src, odd = WorkerClient(a.url), WorkerClient(other.url)

    with pytest.raises(PeerMismatchError, match=next(iter(mismatch))):
        check_peer(src.session_ids().ranks[0], odd.session_ids().ranks[0])
    ids = _ids(16, seed=8)
    _cache(src, ids, "mm")
    size = m.GetRequestExtraTokenSizeResp(extra_token_size=16, matched_token_size=0, total_token_size=16)
    alloc = odd.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key="mm", extra_token_size=16))
    if "weight_version" not in mismatch:  # the source refuses the target's layout (item lens) itself
        alloc = alloc.model_copy(
            update={"per_rank_kv_indices": [m.RankKVIndices(tp=0, pp=0, kv_indices=list(range(16)))]}
        )
    with pytest.raises(MigrationError, match=r"item_lens|mismatch") as err:
        src.transfer(transfer_body(ids, "mm", size, odd.session_ids(), alloc))
    assert err.value.status == 409
    assert a.runtime.endpoint.pool.used_pages == 0 and a.runtime.source.staged_pages == 0, "nothing staged"
    assert not any(m.filled for m in other.runtime.target.pending.values()), "no byte moved"
    odd.abort(alloc.migration_id)
    _clean(a, b, other)
    other.stop()


def test_mismatched_transports_are_refused_before_anything_moves(pair_over) -> None:
    (a, _), (_, b) = pair_over("nixl"), pair_over("http")
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    with pytest.raises(PeerMismatchError, match=r"transport mismatch.*'http'.*'nixl'"):
        check_peer(src.session_ids().ranks[0], dst.session_ids().ranks[0])
    ids = _ids(8, seed=9)
    _cache(src, ids, "transports")
    size = m.GetRequestExtraTokenSizeResp(extra_token_size=8, matched_token_size=0, total_token_size=8)
    alloc = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key="transports", extra_token_size=8))
    body = transfer_body(ids, "transports", size, dst.session_ids(), alloc)
    sglang_body = body.model_copy(
        update={"target_per_rank": [t.model_copy(update={"transport": None}) for t in body.target_per_rank]}
    )
    for refused in (body, sglang_body):  # the source refuses what the target says; else the target refuses the pull
        r = httpx.post(f"{a.url}/transfer_request_kvcache", json=refused.model_dump(), timeout=30)
        assert r.status_code == 409 and "transport mismatch" in r.json()["message"], r.text
        assert not any(mg.filled for mg in b.runtime.target.pending.values()), "no byte moved"
    dst.abort(alloc.migration_id)
    _clean(a, b)
