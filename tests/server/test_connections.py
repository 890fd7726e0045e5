"""What a connection may hold: a body that stalls halfway is answered 408 and closed after ``--body-timeout``, an
idle keep-alive connection is closed after ``--keep-alive-timeout`` (uvicorn's), and past ``--max-connections``
new requests get 503 (uvicorn's ``limit_concurrency``)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx

HEAD = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def _stall(server, sent: bytes = b'{"input_ids": [1, 2, ') -> socket.socket:
    """A client that sent the headers and the start of a 1000-byte body, then stalled."""
    s = socket.create_connection((server.config.host, server.config.port), timeout=10)
    s.sendall(HEAD % 1000 + sent)
    return s


def _read_until_closed(s: socket.socket, within: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (seconds from now)."""
    start, got = time.monotonic(), b""
    s.settimeout(within)
    while True:
        data = s.recv(65536)
        if not data:
            return got, time.monotonic() - start
        got += data


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_stalled_half_sent_body_is_answered_408_and_closed_after_the_timeout(start_server) -> None:
    s = start_server(body_timeout=1.0)
    fds = _fds()
    socks = [_stall(s) for _ in range(20)]
    for sock in socks:
        answer, closed = _read_until_closed(sock, within=15)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert json.loads(body)["success"] is False and "not whole within 1 s" in json.loads(body)["message"]
        assert closed < 15
        sock.close()
    time.sleep(0.2)
    assert _fds() <= fds + 2, "the server keeps no socket of a closed stalled client"
    s.runtime.check_integrity()
    s.stop()


def test_a_trickled_body_is_cut_off_too(start_server) -> None:
    """A body sent a byte every 0.2 s never completes within the timeout: the deadline is the body's, not a gap's."""
    s = start_server(body_timeout=1.0)
    sock = _stall(s, b"{")
    start = time.monotonic()
    try:
        while time.monotonic() - start < 10:
            sock.sendall(b" ")
            time.sleep(0.2)
    except OSError:
        pass  # the server closed the connection
    answer, _ = _read_until_closed(sock, within=10)
    assert time.monotonic() - start < 10 and b"408" in answer.split(b"\r\n")[0]
    sock.close()
    s.stop()


def test_a_body_that_arrives_in_time_is_served(start_server) -> None:
    s = start_server(body_timeout=2.0)
    body = json.dumps({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2}}).encode()
    sock = socket.create_connection((s.config.host, s.config.port), timeout=30)
    sock.sendall(HEAD % len(body) + body[:10])
    time.sleep(0.5)
    sock.sendall(body[10:])
    head = sock.recv(65536).split(b"\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200"), head
    sock.close()
    s.stop()


def test_an_idle_keep_alive_connection_is_closed(start_server) -> None:
    s = start_server(keep_alive_timeout=1)
    sock = socket.create_connection((s.config.host, s.config.port), timeout=30)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    _, closed = _read_until_closed(sock, within=15)
    assert closed < 5, f"idle connection closed after {closed:.1f} s"
    sock.close()
    s.stop()


def test_past_max_connections_requests_get_503_and_their_connections_close(start_server) -> None:
    """uvicorn counts the connections open when a request arrives (its own included): with a bound of 3 and six
    stalled uploads, at most two stay open, the others are answered 503 and closed; then requests pass again."""
    s = start_server(max_connections=3, body_timeout=30.0)
    socks = [_stall(s) for _ in range(6)]
    refused = 0
    try:
        for sock in socks:
            sock.settimeout(3)
            with contextlib.suppress(TimeoutError):  # NOTE: a timeout: still open, its body awaited
                refused += sock.recv(65536).startswith(b"HTTP/1.1 503")
        assert refused >= 4, f"{6 - refused} stalled connections kept past a bound of 3"
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{s.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server never took requests again"
        time.sleep(0.05)
    s.stop()
