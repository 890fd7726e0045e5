"""Two (or more) kvmove servers in threads of the test process, on 127.0.0.1, with small pools."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from kvmove.server.config import ServerConfig
from kvmove.server.launch import ServerThread, free_port
from kvmove.transport import TRANSPORTS

if not TRANSPORTS["nixl"].is_available():
    pytest.skip("the nixl transport is not installed (pip install 'kvmove[nixl]')", allow_module_level=True)

WATCHDOG_S = 2.0


@pytest.fixture(scope="package")
def start_server() -> Iterator[Callable[..., ServerThread]]:
    torch.set_num_threads(1)
    started: list[ServerThread] = []

    def start(**overrides: object) -> ServerThread:
        cfg = dict(
            page_size=4,
            num_pages=48,
            enable_kv_migration=True,
            kv_migration_watchdog_timeout=WATCHDOG_S,
            watchdog_interval=0.1,
        )
        cfg.update(overrides)
        server = ServerThread(ServerConfig(port=free_port(), **cfg)).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="package")
def pair(start_server: Callable[..., ServerThread]) -> tuple[ServerThread, ServerThread]:
    return start_server(), start_server()
