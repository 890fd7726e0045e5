"""What a process holds in tensors: the sum of every distinct tensor storage reachable from Python objects.

A vLLM worker's weights, KV cache, receive slots and any staging all live in tensor storages; summing the distinct
storages (a storage shared by many views or parameters counts once) before and after an update says what the
update added, independently of what kvmove's backend reports about itself. Run it inside the worker
(``collective_rpc``): ``kvmove.vllm.rpc.worker_memory``.
"""

from __future__ import annotations

import gc
from typing import NamedTuple

import torch


class TensorMemory(NamedTuple):
    """Distinct tensor storages of a process, by device type."""

    bytes_by_device: dict[str, int]
    storages: int

    @property
    def total(self) -> int:
        return sum(self.bytes_by_device.values())


def tensor_memory(device: str | None = None) -> TensorMemory:
    """Every distinct storage of a live tensor the garbage collector tracks (``device``: only that device type;
    meta tensors hold no memory and are left out)."""
    gc.collect()
    seen: set[tuple[str, int, int]] = set()
    by_device: dict[str, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
            storage = obj.untyped_storage()
        except Exception:  # tensor subclasses without storage (recording tensors, fakes)
            continue
        kind = storage.device.type
        if device is not None and kind != device:
            continue
        key = (kind, storage.data_ptr(), storage.nbytes())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        by_device[kind] = by_device.get(kind, 0) + storage.nbytes()
    return TensorMemory(by_device, len(seen))
