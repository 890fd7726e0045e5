"""vLLM's ``VLLMWeightSyncClient`` for engines in the trainer's own process: an ``LLM``, or an ``AsyncLLM``.

vLLM ships clients for a server (HTTP routes) and for Ray actors; the protocol is structural (four methods),
so these two adapters are all an engine in the same process needs. ``LLM``'s calls block; an ``AsyncLLM``'s
coroutines run on the event loop that owns the engine (in another thread), so the trainer engine, which calls
from its own threads, never blocks that loop. :class:`EngineGroup` is one client over several engines (an RL
framework's replicas): each call reaches every engine at once and returns when all are done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest


class LLMClient:
    """Drives an ``LLM`` (any engine mode: its workers run wherever vLLM put them)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


class AsyncLLMClient:
    """Drives an ``AsyncLLM`` whose event loop ``loop`` runs in another thread."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 600.0) -> None:
        self.engine, self.loop, self.timeout_s = engine, loop, timeout_s

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._run(self.engine.shutdown_weight_transfer_engine())


class EngineGroup:
    """vLLM's four calls (and shutdown) on every client of ``clients`` concurrently: ``update_weights`` must reach
    every replica at once (they pull from the same trainer ranks in the same sync). A failure on any engine is
    raised once all calls returned."""

    def __init__(self, clients: Sequence[Any]) -> None:
        if not clients:
            raise ValueError("an engine group needs at least one engine client")
        self.clients = list(clients)

    def _all(self, method: str, *args: Any) -> None:
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="kvmove-engines") as pool:
            futures = [pool.submit(getattr(c, method), *args) for c in self.clients]
        for f in futures:
            f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("shutdown_weight_transfer_engine")
