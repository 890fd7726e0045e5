"""No request sees mixed weights unannounced: while a kvmove update is torn, the engine core refuses requests.

kvmove's backend commits an update unit by unit (kvmove.vllm.receiver), so an update that fails half way
leaves the live model with some units new and some old. The backend then raises an error carrying :data:`TORN`;
the engine core (where requests are admitted, which the worker cannot reach) sees it come back from
``collective_rpc`` and refuses every request until a ``finish_weight_update`` succeeds, i.e. until the same update
was retried to completion. In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the refusal is a RuntimeError raised to
the caller of ``generate``; in vLLM's engine-core process a request is answered as aborted and the reason logged
(an exception there would stop the engine). :func:`install` runs from kvmove's ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import functools
from typing import Any

TORN = "kvmove: update torn"
"""Marks a backend error after which the live model holds part of an update."""
FINISH = "finish_weight_update"
_MARK = "_kvmove_guards_torn_updates"
_STATE = "_kvmove_torn"


def refusal(engine_core: Any) -> str | None:
    """Why ``engine_core`` refuses requests now (None: it serves)."""
    torn = getattr(engine_core, _STATE, None)
    if not torn:
        return None
    return (
        f"{torn.splitlines()[0][:400]}; this engine refuses requests until that update is retried to completion "
        "(start_weight_update, update_weights, finish_weight_update)"
    )


def note(engine_core: Any, method: Any, error: BaseException | None) -> None:
    """Track, from one ``collective_rpc`` of ``method``, whether the engine's live model is torn."""
    if error is not None and TORN in str(error):
        setattr(engine_core, _STATE, str(error)[str(error).index(TORN) :])
    elif error is None and method == FINISH:
        setattr(engine_core, _STATE, None)


def install() -> None:
    """Wrap the engine core's ``collective_rpc`` and request admission once per process."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.engine.llm_engine import LLMEngine

    original = EngineCore.collective_rpc
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> Any:
        try:
            out = original(self, method, timeout, args, kwargs)
        except BaseException as exc:
            note(self, method, exc)
            raise
        note(self, method, None)
        return out

    handle = EngineCoreProc._handle_client_request

    @functools.wraps(handle)
    def handle_client_request(self: Any, request_type: Any, request: Any) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        why = refusal(self) if request_type == EngineCoreRequestType.ADD else None
        if why is None:
            return handle(self, request_type, request)
        req = request[0]
        self._send_abort_outputs_to_client([req.request_id], req.client_index)
        from vllm.logger import init_logger

        init_logger(__name__).error("request %s refused: %s", req.request_id, why)
        return None

    add = LLMEngine.add_request

    @functools.wraps(add)
    def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        # in-process only (the engine core is an attribute of the client): refused before the request is
        # registered anywhere, so the next generate does not wait for it
        core = getattr(self.engine_core, "engine_core", None)
        why = refusal(core) if core is not None else None
        if why is not None:
            raise RuntimeError(why)
        return add(self, *args, **kwargs)

    setattr(collective_rpc, _MARK, True)
    EngineCore.collective_rpc = collective_rpc
    EngineCoreProc._handle_client_request = handle_client_request
    LLMEngine.add_request = add_request
