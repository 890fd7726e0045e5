"""Driving workers that speak only the SGLang fork's routes: ``kvmove serve --no-kvmove-routes`` answers SGLang's
routes and the fork's five migration routes and nothing of kvmove's control plane; the controller moves a running
request with ``/abort_request``, the five routes and ``/generate`` only, and it continues token-identical on the
target from the migrated K/V (its prefix cached there)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx
import torch
from server_fixtures import pause_after_decoding

from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import migrate_request_sglang
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.server.messages import GenerateReq, GenerateResp, SamplingParamsMsg


@pytest.fixture(scope="module")
def fork_pair(start_server):
    from kvmove.migration.endpoint import choose_transport

    transport = choose_transport("auto").name
    return start_server(transport=transport, kvmove_routes=False), start_server(
        transport=transport, kvmove_routes=False
    )


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(ids: list[int], n: int) -> list[int]:
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=4))
    w.submit(Request("ref", ids, SamplingParams(max_new_tokens=n)))
    return w.run_until_idle()[0].output_ids


def test_only_sglang_and_fork_routes_are_served(fork_pair) -> None:
    a, _ = fork_pair
    for method, path in [
        ("POST", "/kvmove/hold_request"),
        ("POST", "/kvmove/release_request"),
        ("POST", "/abort_transfer_request_kvcache"),
        ("GET", "/kvmove/integrity"),
    ]:
        assert httpx.request(method, f"{a.url}{path}", json={}).status_code == 404, path
    assert httpx.get(f"{a.url}/get_transfer_session_ids").status_code == 200
    for path in ("/get_request_extra_token_size", "/allocate_token_for_transfer_request", "/transfer_request_kvcache"):
        assert httpx.post(f"{a.url}{path}", json={}).status_code == 400, path  # there, and the body is refused
    assert httpx.post(f"{a.url}/commit_transfer_request_kvcache", json={}).status_code == 404  # unknown id ""
    assert httpx.post(f"{a.url}/abort_request", json={"rid": "nobody"}).status_code == 200


def test_running_request_moves_over_the_fork_routes_and_continues_exactly(fork_pair, monkeypatch) -> None:
    a, b = fork_pair
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids = _ids(22, seed=21)
    body = GenerateReq(
        input_ids=ids,
        rid="fork-move",
        extra_key="fork",
        sampling_params=SamplingParamsMsg(max_new_tokens=40, temperature=0),
    )
    out: dict[str, GenerateResp] = {}
    t = threading.Thread(target=lambda: out.setdefault("src", src.generate(body)))
    t.start()
    pause_after_decoding(monkeypatch, a, "fork-move", tokens=3)  # NOTE: aborted mid-decode, never finished first

    def answer() -> GenerateResp:
        t.join(timeout=30)
        return out["src"]

    rec, resume = migrate_request_sglang(src, dst, body, answer)
    assert rec.ok, rec.error
    partial = out["src"].output_ids
    assert out["src"].meta_info["finish_reason"]["type"] == "abort" and len(partial) >= 3
    assert rec.routes == "sglang" and rec.tokens == ids + partial and rec.bytes > 0
    moved = rec.matched_tokens + rec.extra_tokens
    assert moved == (len(ids) + len(partial) - 1) // 4 * 4, "every whole page the source computed moved"
    assert resume is not None and resume.sampling_params.max_new_tokens == 40 - len(partial)
    done = dst.generate(resume)
    assert done.meta_info["cached_tokens"] == moved, "the target resumed from the migrated K/V"
    assert partial + done.output_ids == _greedy(ids, 40)
    for s in (a, b):
        s.runtime.check_integrity()
        assert not s.runtime.target.pending and s.runtime.endpoint.pool.used_pages == 0
