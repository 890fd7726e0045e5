"""The body limit counts the bytes actually read: a chunked body (no Content-Length) or one longer than it declared
is refused with 413 as soon as it passes the limit, and at most the limit is ever held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest

from kvmove.server.limits import BodyLimitMiddleware

LIMIT = 1 << 20
CHUNK = 64 << 10


def _run(middleware_limit: int, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> dict:
    """Drive the middleware with ``chunks``; returns what the app saw, what was sent and how many were read."""
    seen: dict = {"read": 0, "app_body": None, "sent": []}

    async def app(scope, receive, send) -> None:
        seen["app_body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive() -> dict:
        i = seen["read"]
        seen["read"] += 1
        return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

    async def send(message: dict) -> None:
        seen["sent"].append(message)

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": headers}
    asyncio.run(BodyLimitMiddleware(app, max_bytes=middleware_limit)(scope, receive, send))
    return seen


def test_a_chunked_body_is_cut_off_at_the_limit() -> None:
    chunks = [b"x" * CHUNK] * 1024  # 64 MiB, no Content-Length
    seen = _run(LIMIT, chunks, [])
    assert seen["sent"][0]["status"] == 413 and seen["app_body"] is None
    assert seen["read"] == LIMIT // CHUNK + 1, "stopped reading right after the limit"
    assert b"over the 1048576-byte limit" in seen["sent"][1]["body"]


def test_a_body_longer_than_it_declared_is_cut_off_too() -> None:
    seen = _run(LIMIT, [b"x" * CHUNK] * 32, [(b"content-length", b"10")])
    assert seen["sent"][0]["status"] == 413 and seen["read"] == LIMIT // CHUNK + 1


def test_bodies_within_the_limit_reach_the_route_whole() -> None:
    seen = _run(LIMIT, [b"a" * 10, b"b" * 20, b""], [])
    assert seen["app_body"] == b"a" * 10 + b"b" * 20 and seen["sent"][0]["status"] == 200


@pytest.mark.parametrize(("declared", "status"), [(str(LIMIT + 1).encode(), 413), (b"12abc", 400)])
def test_a_declared_length_is_checked_before_reading(declared: bytes, status: int) -> None:
    seen = _run(LIMIT, [b"{}"], [(b"content-length", declared)])
    assert seen["sent"][0]["status"] == status and seen["read"] == 0


def test_a_live_server_refuses_a_chunked_64_mib_body_early(pair) -> None:
    a, _ = pair
    limit = a.config.max_body_bytes
    with socket.create_connection((a.config.host, a.config.port), timeout=30) as s:
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        s.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        sent, answer, chunk = 0, b"", b"x" * CHUNK
        deadline = time.monotonic() + 60
        while sent < 64 << 20 and time.monotonic() < deadline:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the server answered and closed: the rest is never read
                break
            sent += len(chunk)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                answer += s.recv(65536)
            s.setblocking(True)
            if answer:
                break
        s.settimeout(10)
        while True:  # the refusal says Connection: close, so the answer ends when the server closes
            try:
                data = s.recv(65536)
            except OSError:
                break
            if not data:
                break
            answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert sent < 4 * limit, f"the server kept reading: {sent} bytes sent"
    assert json.loads(body)["success"] is False
    a.runtime.check_integrity()
