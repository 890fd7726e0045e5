"""Stopping the RL loop's vLLM engines: each engine core gets time to stop its worker itself, so neither is killed
while shared memory and semaphores are still linked (the resource tracker's "leaked" warnings at exit)."""

from __future__ import annotations

import tempfile
from typing import Any

from kvmove.rl.engines import ENGINE_SHUTDOWN_S, VllmEngines

VLLM_WORKER_GRACE_S, VLLM_SIGTERM_WAIT_S = 5, 4
"""vLLM 0.32's ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` default, and how long its executor then waits after SIGTERM
(``MultiprocExecutor.shutdown``)."""


class _Core:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append(("core", timeout))


class _LLM:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls
        self.llm_engine = type("Engine", (), {"engine_core": _Core(calls)})()

    def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append(("transfer",))


class _Server:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def close(self) -> None:
        self.calls.append(("server",))


def test_close_gives_each_engine_core_longer_than_its_worker_may_take() -> None:
    # the transfer sides are released while the trainer side they joined is still served, then the cores stop
    calls: list[Any] = []
    engines = object.__new__(VllmEngines)
    engines.llms = [_LLM(calls), _LLM(calls)]
    engines._server = _Server(calls)
    engines._dir = tempfile.TemporaryDirectory(prefix="kvmove-test-")
    engines.close()
    assert calls == [
        ("transfer",),
        ("transfer",),
        ("server",),
        ("core", ENGINE_SHUTDOWN_S),
        ("core", ENGINE_SHUTDOWN_S),
    ]
    assert ENGINE_SHUTDOWN_S > VLLM_WORKER_GRACE_S + VLLM_SIGTERM_WAIT_S + 5
    assert engines.llms == []
