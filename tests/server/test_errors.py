"""Every failure answers the documented body ``{"success": false, "message": ...}``: bodies that do not parse (a
5000-digit integer, a 10,000-deep list), unknown routes and methods; and a peer's failure that says nothing (503
with an empty body) still gives an error naming its status."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx

from kvmove.migration import messages as m
from kvmove.migration.client import WorkerClient
from kvmove.migration.errors import OutOfPagesError, PeerUnreachableError, failure_message

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"input_ids": [' + b"7" * 5000 + b"]}", "digits"),
        (b"[" * 10_000, "recursion"),
        (b'{"input_ids": [1, 2', "JSON"),
        (b"\xff\xfe", ""),
    ],
    ids=["5000-digit-int", "10000-deep", "truncated", "not-utf8"],
)
def test_bodies_that_do_not_parse_get_the_documented_error(server, body: bytes, says: str) -> None:
    for path in ("/generate", "/tokenize", "/get_request_extra_token_size"):
        r = httpx.post(f"{server.url}{path}", content=body, headers=JSON, timeout=30)
        assert r.status_code == 400, (path, r.text[:200])
        got = r.json()
        assert got["success"] is False and isinstance(got["message"], str) and "detail" not in got
        assert says.lower() in got["message"].lower(), got["message"]
    server.runtime.check_integrity()


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/nowhere", 404), ("GET", "/generate", 405)])
def test_unknown_routes_and_methods_get_the_documented_error(server, method: str, path: str, status: int) -> None:
    r = httpx.request(method, f"{server.url}{path}", timeout=30)
    assert r.status_code == status and r.json()["success"] is False and r.json()["message"]


class _Silent(http.server.BaseHTTPRequestHandler):
    """A peer answering every request with 503 and an empty body."""

    def _empty(self) -> None:
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    do_GET = do_POST = _empty

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def silent_peer() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_an_empty_503_from_a_peer_names_its_status(silent_peer: str, server) -> None:
    with WorkerClient(f"http://{silent_peer}", timeout=10) as c, pytest.raises(OutOfPagesError) as info:
        c.metrics()
    assert "HTTP 503 Service Unavailable, empty body" in str(info.value)
    body = m.PullKVReq(input_ids=[], matched_token_size=0, kv_indices=[], sources=[], checksum="")
    with pytest.raises(OutOfPagesError) as info:
        server.runtime.plane.send_pull(silent_peer, body)  # the source's pull request to its target
    assert str(info.value) == f"target {silent_peer}: HTTP 503 Service Unavailable, empty body"


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (409, b'{"success": false, "message": "cache changed"}', "HTTP 409 Conflict: cache changed"),
        (400, b'{"detail": "bad"}', "HTTP 400 Bad Request: bad"),
        (502, b"upstream\n  gone", "HTTP 502 Bad Gateway: upstream gone"),
        (503, b"", "HTTP 503 Service Unavailable, empty body"),
        (500, b"   ", "HTTP 500 Internal Server Error, empty body"),
    ],
)
def test_failure_messages_keep_what_the_peer_said_and_its_status(status: int, body: bytes, says: str) -> None:
    reason = httpx.codes.get_reason_phrase(status)
    assert failure_message(status, reason, body) == says


def test_unreachable_peers_still_say_so(server) -> None:
    with WorkerClient("http://127.0.0.1:1", timeout=5) as c, pytest.raises(PeerUnreachableError):
        c.metrics()
