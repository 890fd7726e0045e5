"""The server's request records: a generation's future and timings, and a request's resume state on the wire.

``resume_state`` and ``generator`` are inverse: what a held request sends to the worker that continues it, and
how that worker rebuilds the sampling generator from it.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvmove.reference import FinishReason, Request, RequestError
from kvmove.server.messages import GenerateResp, ResumeState, SamplingParamsMsg


@dataclass
class InFlight:
    """A generation's future (its HTTP caller waits on it), its timings, and its deadline (``time.monotonic``; None:
    none), which a worker continuing it after a migration inherits."""

    future: Future[GenerateResp]
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    deadline: float | None = None
    on_tokens: Callable[[list[int]], None] | None = None  # a streaming caller's: output ids so far, every step

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 1e-3)


class Submitted(NamedTuple):
    """A request handed to the worker: its id, the future of its answer, its timeout in seconds (None: none)."""

    rid: str
    future: Future[GenerateResp]
    timeout: float | None


class Outcome(enum.Enum):
    ANSWERED = "answered"
    GONE = "gone"  # its client disconnected
    LATE = "late"  # its deadline passed


async def wait_for_answer(
    answer: asyncio.Future[GenerateResp], gone: Awaitable[object] | None, timeout: float | None
) -> Outcome:
    """Wait until ``answer`` is ready, ``gone`` completes (the client left) or ``timeout`` seconds passed; never
    cancels ``answer`` (the worker sets it whatever happens to the waiter)."""
    listener = asyncio.ensure_future(gone) if gone is not None else None
    waiters: set[asyncio.Future[Any]] = {asyncio.shield(answer), *([listener] if listener else [])}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        left = listener is not None and listener.done()
    finally:
        if listener is not None:
            listener.cancel()
    if answer.done():
        return Outcome.ANSWERED
    return Outcome.GONE if left else Outcome.LATE


def abort_reason(message: str) -> dict[str, object]:
    """SGLang's ``finish_reason`` of an aborted request."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def finish_reason(req: Request) -> dict[str, object] | None:
    """SGLang's ``meta_info.finish_reason`` of ``req`` (None while it runs)."""
    if req.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": req.output_ids[-1]}
    if req.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(req.output_ids)}
    if req.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
        return abort_reason(req.error or "aborted")
    return None


def resume_state(req: Request) -> ResumeState:
    """Everything another worker needs to continue ``req`` exactly: tokens, sampling parameters and state."""
    sp = req.sampling
    params = SamplingParamsMsg(
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        stop_token_ids=list(sp.stop_token_ids),
        sampling_seed=sp.seed,
    )
    state = None
    if req.generator is not None:
        state = base64.b64encode(req.generator.get_state().numpy().tobytes()).decode()
    return ResumeState(
        rid=req.rid,
        prompt_ids=req.prompt_ids,
        output_ids=req.output_ids,
        sampling_params=params,
        priority=req.priority,
        extra_key=req.extra_key,
        generator_state=state,
    )


def generator(state: str) -> torch.Generator:
    """The sampling generator ``resume_state`` serialized; RequestError if ``state`` is not one."""
    try:
        raw = bytearray(base64.b64decode(state, validate=True))
        gen = torch.Generator()
        gen.set_state(torch.frombuffer(raw, dtype=torch.uint8))
    except (ValueError, RuntimeError) as exc:
        raise RequestError(f"resume.generator_state is not a valid generator state: {exc}") from exc
    return gen
