"""Functions a vLLM worker runs for ``collective_rpc`` (in the worker's process, whatever the engine mode), once its
``kvmove`` backend is initialized: the bit-exact check ``--verify`` makes.

In vLLM's multi-process engines a function crosses processes only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``;
in-process (``uni``, kvmove's engine actor) it is a plain call.
"""

from __future__ import annotations

from typing import Any


def verify_worker(worker: Any, seed: int, version: int) -> list[str]:
    """The keys where what the live model computes with differs from vLLM's own loader and processing fed
    kvmove's seeded checkpoint of ``version`` (``kvmove.sync.verify.seeded_checkpoint``; what ``--verify``
    checks); empty when bit-exact."""
    return list(verify_report(worker, seed, version)[0])


def verify_report(worker: Any, seed: int, version: int) -> tuple[list[str], int]:
    """:func:`verify_worker`'s keys and how many keys were compared."""
    from kvmove.engines.vllm.join import served_model
    from kvmove.sync.verify import seeded_checkpoint

    weights = seeded_checkpoint(served_model(worker.vllm_config), seed, version)
    return worker.weight_transfer_engine.check(weights)
