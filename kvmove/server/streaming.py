"""The streamed answer of a ``/generate`` request (``stream: true``): server-sent events as SGLang sends them.

Each event is ``data: <json>`` with the answer so far (cumulative ``text`` and ``output_ids``, ``meta_info`` with
``finish_reason`` null until the last), then ``data: [DONE]``. The request is aborted, as a plain one is, when its
client disconnects (noticed while it waits as well as when an event cannot be sent) or its deadline passes (the
last event then carries finish reason abort).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvmove.server.messages import GenerateReq, GenerateResp

if TYPE_CHECKING:
    from kvmove.server.runtime import Runtime

DONE = b"data: [DONE]\n\n"


def event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def stream_answer(rt: Runtime, body: GenerateReq, gone: Callable[[], Awaitable[object]]) -> AsyncIterator[bytes]:
    """Submit ``body`` now (a refused request raises here, before any event) and return its events."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[list[int]] = asyncio.Queue()

    def on_tokens(ids: list[int]) -> None:  # NOTE: on the worker's thread
        loop.call_soon_threadsafe(updates.put_nowait, ids)

    rid, future, timeout = rt.submit(body, on_tokens=on_tokens)
    return _events(rt, rid, asyncio.wrap_future(future), updates, gone, timeout)


async def _events(
    rt: Runtime,
    rid: str,
    answer: asyncio.Future[GenerateResp],
    updates: asyncio.Queue[list[int]],
    gone: Callable[[], Awaitable[object]],
    timeout: float | None,
) -> AsyncIterator[bytes]:
    deadline = None if timeout is None else time.monotonic() + timeout
    listener = asyncio.ensure_future(gone())
    try:
        while not answer.done():
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            update = asyncio.ensure_future(updates.get())
            waiters: set[asyncio.Future[Any]] = {update, asyncio.shield(answer), listener}
            await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if listener.done():
                update.cancel()
                return  # NOTE: the finally aborts it
            if update.done():
                ids = update.result()
                meta = {"id": rid, "finish_reason": None, "completion_tokens": len(ids)}
                yield event({"text": rt.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta})
            else:
                update.cancel()
            if deadline is not None and time.monotonic() >= deadline and not answer.done():
                rt.abandon(rid, f"deadline of {timeout:g} s exceeded (rid {rid})")
                deadline = None
        yield event(answer.result().model_dump())
        yield DONE
    finally:
        listener.cancel()
        if not answer.done():
            rt.abandon(rid, f"client disconnected (rid {rid})")
