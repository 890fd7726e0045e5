"""No KV computed with old weights is served after a kvmove update: the engine core resets its prefix cache.

vLLM's ``finish_weight_update`` reaches the workers through the engine core's ``collective_rpc`` and leaves
the scheduler's prefix cache as it was, so a prompt seen before the update would reuse KV blocks the old
weights computed (only ``pause_generation(clear_cache=True)`` or an explicit ``reset_prefix_cache()`` clear
it). The weight-transfer backend lives in the worker and cannot reach the scheduler; the engine core can. So
:func:`install` (run by kvmove's ``vllm.general_plugins`` entry point in every vLLM process, the engine core's
included) wraps ``EngineCore.collective_rpc``: after a ``finish_weight_update`` succeeds on an engine whose
``weight_transfer_config`` selects kvmove, the engine core resets the prefix cache. Requests still running
then (generation kept across the update) are preempted by the reset and recompute their KV with the new
weights on resume; the tokens they already returned stand.
"""

from __future__ import annotations

import functools
from typing import Any

FINISH = "finish_weight_update"
_MARK = "_kvmove_resets_prefix_cache"


def uses_kvmove(vllm_config: Any) -> bool:
    from kvmove.vllm import BACKEND

    config = getattr(vllm_config, "weight_transfer_config", None)
    return config is not None and getattr(config, "backend", None) == BACKEND


def reset_after_update(engine_core: Any) -> None:
    """Reset ``engine_core``'s prefix cache (and encoder cache, for multimodal models) after an update."""
    try:
        engine_core.reset_prefix_cache(reset_running_requests=True)
        if getattr(engine_core.vllm_config.model_config, "is_multimodal_model", False):
            engine_core.reset_encoder_cache()
    except Exception as exc:
        raise RuntimeError(
            f"kvmove: the new weights are in place, but vLLM could not reset its prefix cache ({exc}); "
            "call reset_prefix_cache() before serving prompts seen before the update"
        ) from exc


def install() -> None:
    """Wrap ``EngineCore.collective_rpc`` once per process (see the module docstring)."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.collective_rpc
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> Any:
        out = original(self, method, timeout, args, kwargs)
        if method == FINISH and uses_kvmove(self.vllm_config):
            reset_after_update(self)
        return out

    setattr(collective_rpc, _MARK, True)
    EngineCore.collective_rpc = collective_rpc
