"""Fixtures for tests that need kvmove servers: servers in threads of the test process, on 127.0.0.1, with small
pools. Loaded by tests/conftest.py (``pytest_plugins``); servers are started on first use and shared by the
session, one pair per KV transport.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvmove.server.launch import ServerThread

WATCHDOG_S = 2.0
SERVER_TRANSPORTS = ("nixl", "http")

Pair = tuple["ServerThread", "ServerThread"]


def skip_unless_installed(transport: str) -> None:
    """Skip the calling test if ``transport`` (or the server stack) is not installed here."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    from kvmove.transport import TRANSPORTS

    cls = TRANSPORTS[transport]
    if not cls.is_available():
        pytest.skip(f"the {transport} transport is not installed (pip install 'kvmove[{cls.extra}]')")


@pytest.fixture(scope="session")
def start_server() -> Iterator[Callable[..., ServerThread]]:
    """``start(**overrides)``: a started server with the test defaults (``ServerConfig`` fields override them)."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    import torch

    from kvmove.ports import free_port
    from kvmove.server.config import ServerConfig
    from kvmove.server.launch import ServerThread

    torch.set_num_threads(1)
    started: list[ServerThread] = []

    def start(**overrides: object) -> ServerThread:
        cfg: dict[str, object] = dict(
            page_size=4,
            num_pages=48,
            enable_kv_migration=True,
            kv_migration_watchdog_timeout=WATCHDOG_S,
            watchdog_interval=0.1,
            migration_share=1.0,  # NOTE: these pools are tiny; tests/migration/test_share.py sets the shares it tests
            peer_share=1.0,
        )
        cfg.update(overrides)
        server = ServerThread(ServerConfig(port=free_port(), **cfg)).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def pair_over(start_server: Callable[..., ServerThread]) -> Callable[[str], Pair]:
    """``pair_over(transport)``: two migration servers moving KV over ``transport`` (skips if not installed)."""
    pairs: dict[str, Pair] = {}

    def get(transport: str) -> Pair:
        skip_unless_installed(transport)
        if transport not in pairs:
            pairs[transport] = (start_server(transport=transport), start_server(transport=transport))
        return pairs[transport]

    return get


@pytest.fixture(scope="session")
def tp_pair_over(start_server: Callable[..., ServerThread]) -> Callable[[str], Pair]:
    """``tp_pair_over(transport)``: two migration servers of tp=2 (skips if ``transport`` is not installed)."""
    pairs: dict[str, Pair] = {}

    def get(transport: str) -> Pair:
        skip_unless_installed(transport)
        if transport not in pairs:
            pairs[transport] = (
                start_server(transport=transport, tp_size=2),
                start_server(transport=transport, tp_size=2),
            )
        return pairs[transport]

    return get


@pytest.fixture
def pair(pair_over: Callable[[str], Pair]) -> Pair:
    """Two migration servers on the transport ``auto`` picks here (nixl where installed, else http)."""
    from kvmove.migration.endpoint import choose_transport

    return pair_over(choose_transport("auto").name)


@pytest.fixture(params=SERVER_TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each KV transport between servers in turn (tests skip the ones not installed)."""
    skip_unless_installed(request.param)
    return str(request.param)


def pause_after_decoding(
    monkeypatch: pytest.MonkeyPatch, server: ServerThread, rid: str, tokens: int = 3
) -> Callable[[], None]:
    """Wait until request ``rid`` has decoded ``tokens`` tokens on ``server`` (a server of this process), and keep
    it there: running, not stepped further, until it leaves the scheduler (held, aborted). Only that request object
    is paused: its continuation, resumed anywhere, runs as usual. So a hold that follows finds it running however
    loaded the machine (on 2 busy cores a short request could otherwise finish before the hold arrived), while what
    the test checks (it moved mid-decode, it continues token for token) stays the same. Returns a function that
    lets the request run on where it is.
    """
    from kvmove.reference import StepOutput

    worker = server.runtime.worker
    real = worker.step
    lock_free = threading.Condition(server.runtime.lock)  # NOTE: waiting on it releases the runtime's lock
    paused: list[object] = []
    let_go = threading.Event()

    def step() -> StepOutput:
        req = worker.scheduler.running.get(rid)
        if not paused and req is not None and len(req.output_ids) >= tokens:
            paused.append(req)
        if paused and req is paused[0] and not let_go.is_set():
            lock_free.wait(timeout=0.002)  # a hold or an abort may take the lock meanwhile
            return StepOutput()
        return real()

    monkeypatch.setattr(worker, "step", step)
    deadline = time.monotonic() + 60
    while not paused:
        assert time.monotonic() < deadline, f"{rid} never decoded {tokens} tokens"
        time.sleep(0.002)
    return let_go.set


def hold_admissions(monkeypatch: pytest.MonkeyPatch, server: ServerThread) -> Callable[[], None]:
    """Keep ``server``'s worker (a server of this process) from stepping until the returned function is called:
    requests submitted meanwhile wait in its queue, and then start together, in one batch."""
    from kvmove.reference import StepOutput

    worker = server.runtime.worker
    real = worker.step
    lock_free = threading.Condition(server.runtime.lock)
    go = threading.Event()

    def step() -> StepOutput:
        if not go.is_set():
            lock_free.wait(timeout=0.002)  # NOTE: releases the runtime's lock, so requests can still be submitted
            return StepOutput()
        return real()

    monkeypatch.setattr(worker, "step", step)
    return go.set
