"""``quantize_many``: block-quantize many tensors with as few kernel launches as their memory allows.

A sync quantizes hundreds of same-shaped tensors per group (one per expert projection). Tensors of one shape,
dtype and strides that are evenly spaced views of one storage (experts laid out back to back in a trainer's
arena, as Megatron's grouped-GEMM weights are) form one ``(n, R, C)`` strided view, quantized in one call of
:func:`kvmove.quant.quantizer.quantize` (one Triton launch on CUDA); others are quantized one by one. Each result
is bit-identical to quantizing that tensor alone: a block never spans two matrices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from kvmove.quant.fp8 import BLOCK, BlockQuantized
from kvmove.quant.quantizer import quantize

MAX_BATCH_ELEMENTS = 1 << 28
"""At most this many elements per call (the torch path holds a float32 copy of its input)."""


def quantize_many(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str] | None = None,
    *,
    block: int = BLOCK,
    backend: str | None = None,
) -> list[BlockQuantized]:
    """``[quantize(t) for t in tensors]``, batched into strided stacks where the tensors' memory allows."""
    names = names if names is not None else [f"tensor {i}" for i in range(len(tensors))]
    out: list[BlockQuantized | None] = [None] * len(tensors)
    for run in _runs(tensors):
        first = tensors[run[0]]
        if len(run) == 1:
            out[run[0]] = quantize(first, block=block, backend=backend, name=names[run[0]])
            continue
        step = tensors[run[1]].storage_offset() - first.storage_offset()
        stack = first.as_strided((len(run), *first.shape), (step, *first.stride()), first.storage_offset())
        label = f"{names[run[0]]} (and {len(run) - 1} more)"
        q = quantize(stack, block=block, backend=backend, name=label)
        for k, i in enumerate(run):
            out[i] = BlockQuantized(q.weight[k], q.scale_inv[k])
    return [q for q in out if q is not None]


def _runs(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` in runs that one strided view covers (evenly spaced, same shape, one storage)."""
    classes: dict[tuple[object, ...], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        key = (t.untyped_storage().data_ptr(), t.device, t.dtype, tuple(t.shape), tuple(t.stride()))
        classes[key].append(i)
    runs: list[list[int]] = []
    for members in classes.values():
        members.sort(key=lambda i: tensors[i].storage_offset())
        run: list[int] = []
        for i in members:
            if run and not _extends(tensors, run, i):
                runs.append(run)
                run = []
            run.append(i)
        runs.append(run)
    return runs


def _extends(tensors: Sequence[torch.Tensor], run: list[int], i: int) -> bool:
    """Whether ``tensors[i]`` continues ``run`` at its spacing, past the previous one's last element."""
    last, t = tensors[run[-1]], tensors[i]
    step = t.storage_offset() - last.storage_offset()
    if not t.numel() or step < _extent(t) or (len(run) + 1) * t.numel() > MAX_BATCH_ELEMENTS:
        return False
    return len(run) == 1 or step == last.storage_offset() - tensors[run[-2]].storage_offset()


def _extent(t: torch.Tensor) -> int:
    """Elements of storage from ``t``'s first element to just past its last."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
