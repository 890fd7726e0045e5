"""Functions a vLLM worker runs for ``collective_rpc`` (in the worker's process, whatever the engine mode), once its
``kvmove`` backend is initialized: the bit-exact check ``--verify`` makes.

In vLLM's multi-process engines a function crosses processes only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``;
in-process (``uni``) it is a plain call. kvmove's engine host (``actor``) drives its vLLM through these. Replies
cross vLLM's msgpack: a NamedTuple arrives as a plain list (the caller rebuilds it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvmove.vllm.verify import Checked


def verify_worker(worker: Any, seed: int, version: int) -> list[str]:
    """The keys where what the live model computes with differs from vLLM's own loader and processing fed
    kvmove's seeded checkpoint of ``version`` (``kvmove.models.weights.seeded_checkpoint``; what ``--verify``
    checks); empty when bit-exact."""
    return list(verify_report(worker, seed, version).bad)


def verify_report(worker: Any, seed: int, version: int) -> Checked:
    """:func:`verify_worker`'s keys and how many keys were compared."""
    from kvmove.models.weights import seeded_checkpoint
    from kvmove.vllm.join import served_model

    weights = seeded_checkpoint(served_model(worker.vllm_config), seed, version)
    return worker.weight_transfer_engine.check(weights)


def verify_saved(worker: Any, directory: str) -> Checked:
    """The keys where what the live model computes with differs from vLLM's own loader and processing fed the
    checkpoint a trainer saved in ``directory`` (``save_pretrained``'s safetensors), and how many were compared."""
    from kvmove.models.weights import saved_checkpoint
    from kvmove.vllm.join import served_model

    weights = saved_checkpoint(served_model(worker.vllm_config), directory)
    return worker.weight_transfer_engine.check(weights)


def check_weights(worker: Any, checkpoint: bytes) -> Checked:
    """:func:`verify_saved` against a full HF checkpoint sent along, in safetensors' bytes (:func:`pack`: tensors
    in a ``collective_rpc`` argument do not survive vLLM's msgpack as tensors)."""
    from safetensors.torch import load

    return worker.weight_transfer_engine.check(load(checkpoint))


def pack(weights: dict[str, Any]) -> bytes:
    """``weights`` as safetensors' bytes, for :func:`check_weights`."""
    from safetensors.torch import save

    return save({n: t.contiguous() for n, t in weights.items()})


def live_state(worker: Any) -> bytes:
    """What the live model computes with (``kvmove.vllm.verify.computed_state``), as :func:`pack`'s
    bytes (``safetensors.torch.load`` reads them)."""
    from kvmove.vllm.verify import computed_state

    return pack(computed_state(worker.weight_transfer_engine.current().require()))


class SyncReport(NamedTuple):
    """The worker's side of the last update: its puller's stats, the seconds ``finish`` took, and its extra memory
    (``kvmove.vllm.session.Memory``, as a plain list)."""

    stats: Any
    finish_seconds: float
    memory: Any = None


def sync_report(worker: Any) -> SyncReport:
    s = worker.weight_transfer_engine.current()
    return SyncReport(s.last_stats, s.finish_seconds, None if s.memory is None else list(s.memory))


def worker_memory(worker: Any) -> int:
    """Bytes of every distinct tensor storage the worker's process holds now (kvmove.vllm.memory)."""
    from kvmove.vllm.memory import tensor_memory

    return tensor_memory().total


def watch_memory(worker: Any) -> None:
    """From now on, measure the worker's tensor memory after every module's processing, before its commit (where
    an update's extra memory peaks); :func:`watched_memory` returns the highest."""
    from kvmove.vllm.memory import tensor_memory

    staging = worker.weight_transfer_engine.current().stager
    seen: list[int] = []
    staging.ledger.probe = lambda _module: seen.append(tensor_memory().total)
    staging.watched = seen


def watched_memory(worker: Any) -> int:
    """The highest of what :func:`watch_memory` measured since it was set, 0 if nothing (and stop watching)."""
    staging = worker.weight_transfer_engine.current().stager
    seen = list(getattr(staging, "watched", []))
    staging.watched, staging.ledger.probe = [], None
    return max(seen, default=0)


class WorkerMemory(NamedTuple):
    """A worker's tensor memory before its ``kvmove`` backend's init and now, and its staging's sizes
    (:func:`staging_bounds`)."""

    before_init: int
    now: int
    bounds: dict[str, int]


def staging_bounds(worker: Any) -> dict[str, int]:
    """The worker's staging facts the memory bound is stated in: the window, its slots, the largest unit and the
    largest staged module (unprocessed bytes), the model's parameter bytes, and the last update's receive slots
    and reported peak."""
    from kvmove.vllm.staging import param_bytes

    s = worker.weight_transfer_engine.current()
    layout = s.stager.stager.window.layout
    metas = {p.name: p for p in s.plan.params}
    modules = [sum(param_bytes(metas[f]) for f in local.values()) for local in s.stager.owners.values()]
    return {
        "window_bytes": layout.nbytes,
        "slots": layout.slots,
        "unit_bytes": layout.slot_bytes,
        "module_bytes": max(modules, default=0),
        "model_bytes": sum(param_bytes(p) for p in s.plan.params),
        "recv_bytes": 0 if s.memory is None else s.memory.recv_bytes,
        "peak_extra_bytes": 0 if s.memory is None else s.memory.peak_extra_bytes,
    }


class TransferState(NamedTuple):
    """How the worker's ``kvmove`` backend is wired (what tests check of kvmove's own engine host)."""

    pid: int
    session: str
    joined: dict[str, Any] | None
    """The join info its puller was built from (None: a puller attached in-process)."""


def transfer_state(worker: Any) -> TransferState:
    import os

    s = worker.weight_transfer_engine.current()
    return TransferState(os.getpid(), s.key, None if s.joined is None else s.joined.payload())
