"""Migrations between workers of tensor-parallel ranks: tp=2 <-> tp=2 and tp=2 <-> tp=1, over every KV transport.

One migration id covers every rank of a worker; each target rank reads from the source ranks only the KV heads it
holds (heads resharded on the way when the two workers split them differently), the migrated K/V lands
bit-exact on every rank, and the request continues token-identical to a run that never moved. Integrity holds on
every rank of both workers after every path.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import torch
from server_fixtures import pause_after_decoding

from kvmove.migration import messages as m
from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import migrate_request, resume_body, transfer_body
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.server.messages import GenerateReq, GenerateResp, SamplingParamsMsg

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 16, 4  # qwen3-tiny, float32
TOKEN_BYTES = HEADS * HEAD_DIM * 4 * 2 * LAYERS  # K and V of every head of every layer, one token


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(ids: list[int], n: int) -> list[int]:
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=PAGE))
    w.submit(Request("ref", ids, SamplingParams(max_new_tokens=n)))
    return w.run_until_idle()[0].output_ids


@pytest.fixture(params=[(2, 2), (2, 1), (1, 2)], ids=lambda p: f"tp{p[0]}-to-tp{p[1]}")
def servers(request, pair_over, tp_pair_over, transport: str):
    """(source, target) of the requested tensor parallelism, over ``transport``."""
    src_tp, dst_tp = request.param
    one, two = pair_over(transport), tp_pair_over(transport)
    return (two[0] if src_tp == 2 else one[0]), (two[1] if dst_tp == 2 else one[1])


def _clean(*servers) -> None:
    for s in servers:
        s.runtime.check_integrity()
        assert not s.runtime.target.pending
        assert all(e.pool.used_pages == 0 for e in s.runtime.plane.endpoints), "host pages leaked"
        assert s.runtime.plane.open_grants == 0


def _kv(server, tokens: list[int], key: str) -> torch.Tensor:
    """The K/V of ``tokens`` cached on ``server``, whole heads: [layers, 2, tokens, heads, head_dim]."""
    w = server.runtime.worker
    pages = w.export_request_kv(tokens=tokens, extra_key=key).pages
    assert pages.numel() * PAGE == len(tokens), "all of it cached"
    slots = w.pool.token_slots(pages)
    per_layer = []
    for layer in range(LAYERS):
        parts = [p.read(layer, slots) for p in w.pools]
        k = torch.cat([kv.k for kv in parts], dim=1)
        v = torch.cat([kv.v for kv in parts], dim=1)
        per_layer.append(torch.stack([k, v]))
    return torch.stack(per_layer)


def test_protocol_moves_each_ranks_heads_bit_exact_under_one_migration_id(servers, transport: str) -> None:
    a, b = servers
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    key = f"tp-exact-{a.config.tp_size}-{b.config.tp_size}-{transport}"
    ids = _ids(24, seed=11)
    src.generate(
        GenerateReq(input_ids=ids, sampling_params=SamplingParamsMsg(max_new_tokens=1, temperature=0), extra_key=key)
    )
    theirs = dst.session_ids()
    assert theirs.topology.tp_size == b.config.tp_size == len(theirs.ranks)
    assert [r.geometry.head_start for r in theirs.ranks] == list(range(0, HEADS, HEADS // b.config.tp_size))
    size = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    alloc = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_key=key, extra_token_size=24))
    assert [(r.tp, r.pp, len(r.kv_indices)) for r in alloc.per_rank_kv_indices] == [
        (t, 0, 24) for t in range(b.config.tp_size)
    ], "one migration id, an allocation on every rank"
    done = src.transfer(transfer_body(ids, key, size, theirs, alloc))
    assert done.bytes == 24 * TOKEN_BYTES, "every target rank read exactly the heads it holds, once"
    assert dst.commit(alloc.migration_id).matched_after_commit == 24
    assert torch.equal(_kv(b, ids, key), _kv(a, ids, key)), "the K/V landed bit-exact, heads where each rank wants them"
    _clean(a, b)


def test_migrated_request_continues_token_identical(servers, transport: str, monkeypatch) -> None:
    a, b = servers
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids = _ids(21, seed=12)
    rid = f"tp-cont-{a.config.tp_size}-{b.config.tp_size}-{transport}"
    body = GenerateReq(
        input_ids=ids, rid=rid, extra_key=rid, sampling_params=SamplingParamsMsg(max_new_tokens=40, temperature=0)
    )
    out: dict[str, GenerateResp] = {}
    t = threading.Thread(target=lambda: out.setdefault("src", src.generate(body)))
    t.start()
    pause_after_decoding(monkeypatch, a, rid, tokens=3)  # NOTE: held mid-decode, never finished before the hold
    rec = migrate_request(src, dst, rid)
    assert rec.ok, rec.error
    t.join(timeout=30)
    assert out["src"].meta_info["migrated_to"] == b.url
    done = dst.generate(resume_body(rec.held))
    assert rec.held is not None and len(rec.held.request.output_ids) >= 3
    assert done.output_ids == _greedy(ids, 40)
    assert done.meta_info["cached_tokens"] == len(rec.held.input_ids) > 0, "resumed from migrated K/V"
    assert rec.bytes == len(rec.held.input_ids) * TOKEN_BYTES
    _clean(a, b)
