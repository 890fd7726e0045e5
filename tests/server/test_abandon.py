"""Nobody computes for nobody: a /generate request whose client disconnects is aborted at once wherever it is
(waiting, running, held for a migration, continued on a migration target), its pages and locks released; a
request's deadline (its own ``timeout``, else the server's ``--request-timeout``) aborts it too, answering what it
generated so far."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx
import torch
from server_fixtures import pause_after_decoding

from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import migrate_request
from kvmove.migration.errors import UnknownMigrationError
from kvmove.server.messages import GenerateReq, SamplingParamsMsg

LONG = {"max_new_tokens": 1500, "temperature": 0}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _send(server, body: dict) -> socket.socket:
    """A client that sent ``body`` to ``/generate`` and waits; closing the socket is its disconnect."""
    raw = json.dumps(body).encode()
    s = socket.create_connection((server.config.host, server.config.port), timeout=10)
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    s.sendall(head % len(raw) + raw)
    return s


def _until(check, within: float, what: str) -> float:
    """Seconds until ``check()`` held (polled); fails naming ``what`` after ``within`` seconds."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within, f"{what} not within {within} s"
        time.sleep(0.01)
    return time.monotonic() - start


def _idle(server) -> bool:
    stats = server.runtime.worker.stats()
    return stats.running == 0 and sum(stats.waiting_per_priority.values()) == 0


def _holds_nothing(server) -> None:
    res = server.runtime.resources()
    assert res.inflight_requests == res.held_requests == res.export_locks == res.device_locked_pages == 0, res
    stats = server.runtime.worker.stats()
    assert stats.used_pages == stats.cached_pages, "every page in use is an unlocked cached page (evictable)"
    server.runtime.check_integrity()


def test_twenty_abandoned_requests_free_everything_within_a_second(start_server) -> None:
    """The issue's probe: 20 clients of 1500-token requests give up after 0.2 s; 1 s later nothing runs or waits,
    every page is free (after a flush), and a new request is served at once."""
    s = start_server(num_pages=512, page_size=16, max_running=16)
    gave_up: list[str] = []

    def client(i: int) -> None:
        try:
            body = {"input_ids": _ids(30, i), "sampling_params": LONG}
            httpx.post(f"{s.url}/generate", json=body, timeout=0.2)
        except httpx.TimeoutException as exc:
            gave_up.append(type(exc).__name__)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(gave_up) == 20, gave_up
    _until(lambda: _idle(s), 1.0, "0 running and 0 waiting")
    _holds_nothing(s)
    start = time.monotonic()
    with WorkerClient(s.url, timeout=60) as c:
        out = c.generate(GenerateReq(input_ids=_ids(30, 99), sampling_params=SamplingParamsMsg(max_new_tokens=16)))
        served = time.monotonic() - start
        assert len(out.output_ids) == 16 and out.meta_info["finish_reason"]["type"] == "length"
        assert served < 5, f"the new request took {served:.1f} s: it queued behind abandoned ones"
        assert c.flush_cache().freed_pages >= 0
    stats = s.runtime.worker.stats()
    assert stats.free_pages == stats.total_pages
    s.stop()


def test_a_disconnect_aborts_a_waiting_request_and_a_running_one(start_server) -> None:
    """With one batch slot, one request runs and one waits; both clients leave; both are gone at once."""
    s = start_server(num_pages=256, page_size=16, max_running=1)
    socks = [_send(s, {"input_ids": _ids(30, i), "sampling_params": LONG, "rid": f"r{i}"}) for i in range(2)]
    _until(lambda: s.runtime.worker.stats().running == 1 and s.runtime.worker.scheduler.get("r1"), 30, "r1 queued")
    for sock in socks:
        sock.close()
    _until(lambda: _idle(s), 1.0, "both aborted")
    _holds_nothing(s)
    s.stop()


@pytest.mark.parametrize("where", ["request", "server"])
def test_a_deadline_aborts_and_answers_what_was_generated(start_server, where: str) -> None:
    s = start_server(num_pages=256, page_size=16, request_timeout=0.5 if where == "server" else 0.0)
    body = GenerateReq(input_ids=_ids(30, 5), sampling_params=SamplingParamsMsg(**LONG))
    if where == "request":
        body = body.model_copy(update={"timeout": 0.5})
    start = time.monotonic()
    with WorkerClient(s.url, timeout=60) as c:
        out = c.generate(body)
    took = time.monotonic() - start
    reason = out.meta_info["finish_reason"]
    assert reason["type"] == "abort" and "deadline of 0.5 s exceeded" in reason["message"], reason
    assert 0.5 <= took < 5 and len(out.output_ids) < 1500
    _until(lambda: _idle(s), 1.0, "the late request gone")
    _holds_nothing(s)
    s.stop()


def test_a_timeout_that_is_not_a_positive_number_is_refused(start_server) -> None:
    s = start_server()
    for bad in (0, -1, "soon"):
        r = httpx.post(f"{s.url}/generate", json={"input_ids": [1, 2], "timeout": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["success"] is False and "timeout" in r.json()["message"]
    s.stop()


def test_a_held_request_whose_client_leaves_is_let_go(start_server, monkeypatch) -> None:
    s = start_server(num_pages=512, page_size=4)
    sock = _send(s, {"input_ids": _ids(40, 7), "rid": "held", "sampling_params": LONG})
    pause_after_decoding(monkeypatch, s, "held", tokens=2)
    with WorkerClient(s.url, timeout=60) as c:
        c.hold("held")
        assert s.runtime.resources().device_locked_pages > 0
        sock.close()
        _until(lambda: not s.runtime.held.held, 1.0, "the held request let go")
        _holds_nothing(s)
        with pytest.raises(UnknownMigrationError):
            c.release("held", migrated=False)
    s.stop()


def test_a_migrated_request_whose_client_leaves_is_aborted_on_its_target(start_server, monkeypatch) -> None:
    """The source relays the target's answer; when the source's client leaves, the target aborts the request too
    (the source asks it to), and neither worker holds anything of it."""
    a = start_server(num_pages=512, page_size=4, kv_migration_watchdog_timeout=60)
    b = start_server(num_pages=512, page_size=4, kv_migration_watchdog_timeout=60)
    sock = _send(a, {"input_ids": _ids(40, 8), "rid": "moved", "sampling_params": LONG})
    pause_after_decoding(monkeypatch, a, "moved", tokens=2)
    with WorkerClient(a.url, timeout=60) as src, WorkerClient(b.url, timeout=60) as dst:
        rec = migrate_request(src, dst, "moved")
        assert rec.ok, rec.error
    _until(lambda: b.runtime.worker.scheduler.get("moved") is not None, 30, "the target continuing it")
    sock.close()
    _until(lambda: _idle(b) and not a.runtime.held.held, 2.0, "aborted on the target, let go on the source")
    for s in (a, b):
        _holds_nothing(s)
        s.stop()


def _events(lines) -> list:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_a_streamed_answer_grows_token_by_token_and_ends_with_done(start_server) -> None:
    s = start_server(num_pages=256, page_size=16)
    body = {"input_ids": _ids(30, 11), "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "stream": True}
    with httpx.stream("POST", f"{s.url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 6
    for earlier, later in itertools.pairwise(chunks):  # cumulative, each a prefix of the next
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1]) and len(chunks) >= 2
    with WorkerClient(s.url, timeout=60) as c:  # the same tokens as the plain answer
        plain = c.generate(
            GenerateReq(input_ids=body["input_ids"], sampling_params=SamplingParamsMsg(max_new_tokens=6, temperature=0))
        )
    assert plain.output_ids == final["output_ids"]
    s.stop()


def test_a_streaming_client_that_leaves_aborts_its_request(start_server) -> None:
    s = start_server(num_pages=256, page_size=16, max_running=1)
    socks = [_send(s, {"input_ids": _ids(30, 20 + i), "sampling_params": LONG, "stream": True}) for i in range(2)]
    _until(lambda: s.runtime.worker.stats().running == 1, 30, "one streaming, one queued")
    assert socks[0].recv(4096).startswith(b"HTTP/1.1 200")
    for sock in socks:
        sock.close()
    _until(lambda: _idle(s), 1.0, "both streamed requests aborted")
    _holds_nothing(s)
    s.stop()


def test_a_streamed_request_past_its_deadline_ends_with_an_abort(start_server) -> None:
    s = start_server(num_pages=256, page_size=16)
    body = {"input_ids": _ids(30, 12), "sampling_params": LONG, "stream": True, "timeout": 0.5}
    with httpx.stream("POST", f"{s.url}/generate", json=body, timeout=60) as r:
        events = _events(r.iter_lines())
    final = json.loads(events[-2])
    assert events[-1] == "[DONE]" and final["meta_info"]["finish_reason"]["type"] == "abort"
    assert "deadline of 0.5 s exceeded" in final["meta_info"]["finish_reason"]["message"]
    _until(lambda: _idle(s), 1.0, "the late streamed request gone")
    _holds_nothing(s)
    s.stop()
