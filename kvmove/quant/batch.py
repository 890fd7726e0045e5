"""``quantize_many``: block-quantize many tensors with as few kernel launches as their memory allows.

A sync quantizes hundreds of same-shaped tensors per group (one per expert projection). Tensors of one shape,
dtype and strides that are evenly spaced views of one storage (experts laid out back to back in a trainer's
arena, as Megatron's grouped-GEMM weights are) form one ``(n, R, C)`` strided view, quantized in one call of
:func:`kvmove.quant.quantizer.quantize` (one Triton launch on CUDA); others are quantized one by one. Each result
is bit-identical to quantizing that tensor alone: a block never spans two matrices.

:func:`stacked_runs` finds such runs over tuples of tensors (one per role: a sync's pull programs stack a cover's
source and its outputs together, kvmove.sync.programs); ``quantize_many`` uses it with one role.
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
    for run, (stack,) in stacked_runs([(t,) for t in tensors], MAX_BATCH_ELEMENTS):
        if len(run) == 1:
            out[run[0]] = quantize(tensors[run[0]], block=block, backend=backend, name=names[run[0]])
            continue
        label = f"{names[run[0]]} (and {len(run) - 1} more)"
        q = quantize(stack, block=block, backend=backend, name=label)
        for k, i in enumerate(run):
            out[i] = BlockQuantized(q.weight[k], q.scale_inv[k])
    return [q for q in out if q is not None]


CANDIDATES = 8
"""Second members tried per run (the step is the one giving the longest run): a layer's experts interleave gate
and up projections in the arena, while a pull's slot holds every expert's three covers in turn."""


def stacked_runs(
    items: Sequence[tuple[torch.Tensor, ...]], limit: int | None = None
) -> list[tuple[list[int], tuple[torch.Tensor, ...]]]:
    """Group ``items`` (tuples of tensors, one per role) into runs that strided stacks cover: within a run every
    role's tensors share storage, dtype, shape and strides, and lie evenly spaced without overlap. Each run: its
    item indices and, per role, the ``(n, *shape)`` stack (one item: its tensors with a leading dim of 1).
    ``limit``: at most this many elements per stack of the first role."""
    classes: dict[tuple[object, ...], list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        classes[tuple(_key(t) for t in item)].append(i)
    out = []
    for members in classes.values():
        members.sort(key=lambda i: items[i][0].storage_offset())
        out += [(run, _stack(items, run)) for run in _progressions(items, members, limit)]
    return out


def _key(t: torch.Tensor) -> tuple[object, ...]:
    return (t.untyped_storage().data_ptr(), t.device, t.dtype, tuple(t.shape), tuple(t.stride()))


def _progressions(items: Sequence[tuple[torch.Tensor, ...]], members: list[int], limit: int | None) -> list[list[int]]:
    """``members`` (one class, sorted by first-role offset) cut into evenly spaced runs, greedily: each run starts
    at the first free member and takes, of the steps to the next CANDIDATES free members, the longest run."""
    offsets = [tuple(int(t.storage_offset()) for t in items[i]) for i in members]
    extents = [_extent(t) for t in items[members[0]]]
    numel = items[members[0]][0].numel()
    most = 1 if not numel else len(members) if limit is None else max(1, limit // numel)
    where: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for k, off in enumerate(offsets):
        where[off].append(k)
    free = dict.fromkeys(range(len(members)))  # an insertion-ordered set
    runs = []
    for a in range(len(members)):
        if a not in free:
            continue
        del free[a]
        best = [a]
        for b in [k for k in free if k > a][:CANDIDATES] if most > 1 else []:
            step = [y - x for x, y in zip(offsets[a], offsets[b], strict=True)]
            if any(d < e for d, e in zip(step, extents, strict=True)):
                continue
            run = [a, b]
            while len(run) < most:
                want = tuple(x + d for x, d in zip(offsets[run[-1]], step, strict=True))
                nxt = next((k for k in where.get(want, ()) if k in free and k not in run), None)
                if nxt is None:
                    break
                run.append(nxt)
            best = run if len(run) > len(best) else best
        for k in best[1:]:
            del free[k]
        runs.append([members[k] for k in best])
    return runs


def _stack(items: Sequence[tuple[torch.Tensor, ...]], run: list[int]) -> tuple[torch.Tensor, ...]:
    first = items[run[0]]
    if len(run) == 1:
        return tuple(t.unsqueeze(0) for t in first)
    second = items[run[1]]
    return tuple(
        t.as_strided((len(run), *t.shape), (u.storage_offset() - t.storage_offset(), *t.stride()), t.storage_offset())
        for t, u in zip(first, second, strict=True)
    )


def _extent(t: torch.Tensor) -> int:
    """Elements of storage from ``t``'s first element to just past its last."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
