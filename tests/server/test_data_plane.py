"""The KV data plane as a server shows it: which transport it uses (and that a fallback to http is reported), and
the http transport's read route refusing every read it must not answer, with a clear 4xx and nothing changed."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx
import torch

from kvmove.migration.endpoint import FALLBACK_NOTE
from kvmove.transport import NixlTransport
from kvmove.transport.http_route import READ_PATH


def _fingerprint(server) -> str:
    """Hash of every host KV byte of ``server``: reads must not change any."""
    digest = hashlib.sha256()
    for buf in server.runtime.endpoint.pool.buffers():
        digest.update(buf.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _read(server, **fields: object) -> httpx.Response:
    endpoint = server.runtime.endpoint.transport.endpoint
    body = {"endpoint": endpoint, "buffer_id": 0, "grant": "none", "spans": [[0, 64]], **fields}
    return httpx.post(f"{server.url}{READ_PATH}", json=body, timeout=30)


def test_auto_falls_back_to_http_and_says_so(monkeypatch, start_server) -> None:
    monkeypatch.setattr(NixlTransport, "is_available", classmethod(lambda cls: False))
    s = start_server(transport="auto")
    metrics = httpx.get(f"{s.url}/metrics.json").json()
    assert metrics["transport"] == "http" and metrics["transport_note"] == FALLBACK_NOTE
    assert "slower fallback" in FALLBACK_NOTE and "pip install 'kvmove[nixl]'" in FALLBACK_NOTE
    (rank,) = httpx.get(f"{s.url}/get_transfer_session_ids").json()["ranks"]
    assert rank["transport"] == "http"
    s.stop()


@pytest.mark.parametrize("transport", ["nixl", "http"])
def test_a_named_transport_is_used_without_a_note(pair_over, transport: str) -> None:
    a, _ = pair_over(transport)
    metrics = httpx.get(f"{a.url}/metrics.json").json()
    assert (metrics["transport"], metrics["transport_note"]) == (transport, "")


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[]", 400, "exactly the keys"),
        (json.dumps({"buffer_id": 0, "grant": "g", "spans": []}).encode(), 400, "exactly the keys"),
        ({"buffer_id": "0"}, 400, "wrong type: buffer_id"),
        ({"spans": [[0, 1.5]]}, 400, "integer pairs"),
        ({"spans": [[0, 8, 1]]}, 400, "integer pairs"),
        ({"spans": [[-8, 8]]}, 400, "non-negative"),
        ({"spans": [[0, 1 << 70]]}, 400, "64 bits"),
        ({"buffer_id": 99}, 404, "buffer 99 is not registered"),
        ({"endpoint": "http-somebody-else"}, 404, "not served here"),
        ({"spans": [[0, 64], [1 << 30, 64]]}, 400, "past the"),
        ({"spans": [[(1 << 62), (1 << 62)]]}, 400, "past the"),
        ({}, 403, "unknown or was revoked"),
    ],
)
def test_bad_reads_are_refused_and_change_nothing(pair_over, body: object, status: int, message: str) -> None:
    a, _ = pair_over("http")
    before = _fingerprint(a)
    if isinstance(body, bytes):
        r = httpx.post(f"{a.url}{READ_PATH}", content=body, headers={"content-type": "application/json"})
    else:
        r = _read(a, **body)
    assert r.status_code == status, r.text
    assert r.json()["success"] is False and message in r.json()["message"]
    assert _fingerprint(a) == before
    a.runtime.check_integrity()
    assert a.runtime.endpoint.open_grants == 0


def test_a_grant_covers_only_the_offered_outbox_pages_until_withdrawn(pair_over) -> None:
    a, _ = pair_over("http")
    endpoint = a.runtime.endpoint
    pages = endpoint.stage(1)
    try:
        endpoint.outbox.buffers()[3][pages] = 1.5
        offer = endpoint.offer("test", "0", pages)
        grant = json.loads(base64.b64decode(offer.endpoint_info))["grant"]
        assert endpoint.open_grants == 1
        item, page, out3 = endpoint.pool.item_lens()[0], int(pages[0]), offer.buffers[3].buffer_id
        ok = _read(a, grant=grant, buffer_id=out3, spans=[[page * item, item]])
        assert ok.status_code == 200 and ok.headers["content-type"] == "application/octet-stream"
        expected = endpoint.outbox.buffers()[3].view(-1).view(torch.uint8)[page * item : (page + 1) * item]
        assert ok.content == expected.numpy().tobytes() and any(ok.content)
        for buffer_id, span in (
            (out3, [(page + 1) % endpoint.pool.num_pages * item, item]),  # another page
            (out3, [page * item + item // 2, item]),  # straddling into one
            (3, [page * item, item]),  # the same page of the inbox: never offered
        ):
            outside = _read(a, grant=grant, buffer_id=buffer_id, spans=[span])
            assert outside.status_code == 403 and "outside what the read grant allows" in outside.json()["message"]
        endpoint.withdraw(offer)
        assert _read(a, grant=grant, buffer_id=out3, spans=[[page * item, item]]).status_code == 403
        assert endpoint.open_grants == 0
    finally:
        endpoint.unstage(pages)
    assert not endpoint.outbox.buffers()[3][pages].any(), "unstaged pages are scrubbed"
    a.runtime.check_integrity()


def test_read_route_refused_where_http_is_not_the_transport(pair_over, start_server) -> None:
    a, _ = pair_over("nixl")
    r = _read(a)
    assert r.status_code == 404 and "moves KV over nixl" in r.json()["message"]
    plain = start_server(enable_kv_migration=False)
    r = httpx.post(f"{plain.url}{READ_PATH}", json={})
    assert r.status_code == 404, "kvmove's migration routes are not served without --enable-kv-migration"
    plain.stop()


def _ints(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [i for v in value.values() for i in _ints(v)]
    if isinstance(value, list):
        return [i for v in value for i in _ints(v)]
    return []


def test_no_memory_address_leaves_a_server_over_http(pair_over, monkeypatch) -> None:
    """Over the http data plane every body a peer (or the controller) can receive, requests and answers, of a whole
    migration with its hand-over, holds opaque handles only: no ``address`` key, no number inside any of either
    server's host buffers."""
    import threading

    from server_fixtures import pause_after_decoding

    from kvmove.migration.client import WorkerClient
    from kvmove.migration.controller import migrate_request
    from kvmove.server.limits import BodyLimitMiddleware
    from kvmove.server.messages import GenerateReq, GenerateResp, SamplingParamsMsg

    a, b = pair_over("http")
    bodies: list[tuple[str, bytes]] = []
    real = BodyLimitMiddleware.__call__

    async def recording(self, scope, receive, send) -> None:
        async def rec_receive():
            message = await receive()
            bodies.append((f"-> {scope.get('path')}", message.get("body", b"")))
            return message

        async def rec_send(message) -> None:
            if message["type"] == "http.response.body" and scope.get("path") != READ_PATH:
                bodies.append((f"<- {scope.get('path')}", message.get("body", b"")))
            await send(message)

        await real(self, scope, rec_receive, rec_send)

    monkeypatch.setattr(BodyLimitMiddleware, "__call__", recording)
    rid = "addresses"
    body = GenerateReq(input_ids=list(range(1, 33)), rid=rid, sampling_params=SamplingParamsMsg(max_new_tokens=12))
    out: dict[str, GenerateResp] = {}
    t = threading.Thread(target=lambda: out.setdefault("r", WorkerClient(a.url, timeout=120).generate(body)))
    t.start()
    pause_after_decoding(monkeypatch, a, rid, tokens=1)
    with WorkerClient(a.url) as src, WorkerClient(b.url) as dst:
        rec = migrate_request(src, dst, rid)
    t.join(timeout=120)
    assert rec.ok and rec.bytes > 0 and out["r"].meta_info["migrated_to"] == b.url, rec.error
    paths = {p for p, _ in bodies}
    assert {"-> /kvmove/pull_kv", "-> /kvmove/read_pages", "<- /get_transfer_session_ids", "-> /generate"} <= paths
    spans = [
        (buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size())
        for s in (a, b)
        for e in s.runtime.plane.endpoints
        for buf in (*e.pool.buffers(), *e.outbox.buffers())
    ]
    for path, raw in bodies:
        if not raw.strip():
            continue
        doc = json.loads(raw)
        assert b'"address"' not in raw, f"{path} names an address: {raw[:300]!r}"
        inside = [i for i in _ints(doc) for lo, hi in spans if lo <= i < hi]
        assert not inside, f"{path} carries {len(inside)} numbers inside host buffers"
    a.runtime.check_integrity()
    b.runtime.check_integrity()
