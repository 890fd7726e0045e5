"""The engine's scatter of :mod:`kvmove.sync.delta.apply` as one Triton kernel (CUDA): every changed word of a pull
written into its parameter, whichever of the pull's parameters holds it, in one launch.

Each program takes a block of the delta's positions (ascending), finds each one's part by a binary search over the
parts' first positions (a few hundred at most, read from cache), and stores its value at the position plus the
part's shift: the part's first word in its storage, counted from the first storage's first word (every storage
is word-aligned, so parameters of any number of storages are addressed from one pointer). The torch path
(:meth:`kvmove.sync.delta.apply.Scatter.put`) needs one indexed copy per run of parts sharing a storage, and a
host synchronization for the runs' bounds; an MoE layer's pull lands in hundreds of storages.

Only contiguous parts whose element is a whole number of words use it (BF16 parameters: the common case); the
rest take the torch path. ``tests/sync/delta/test_triton_diff_interpreter.py`` checks it under Triton's CPU
interpreter against torch, and ``tests/sync/delta/test_triton_diff_gpu.py`` compiled. Imported lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Positions per program."""


@triton.jit(do_not_specialize=["n", "parts", "steps"])
def _scatter_kernel(base_ptr, pos_ptr, val_ptr, bounds_ptr, shifts_ptr, n, parts, steps, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    p = tl.load(pos_ptr + i, mask=inside, other=0)
    lo = tl.zeros((BLOCK,), dtype=tl.int32)
    hi = tl.zeros((BLOCK,), dtype=tl.int32) + parts
    for _ in range(steps):  # bounds[lo] <= p < bounds[hi]
        mid = (lo + hi) // 2
        go = tl.load(bounds_ptr + mid) <= p
        open_ = hi - lo > 1
        lo = tl.where(open_ & go, mid, lo)
        hi = tl.where(open_ & ~go, mid, hi)
    shift = tl.load(shifts_ptr + lo)
    tl.store(base_ptr + p + shift, tl.load(val_ptr + i, mask=inside), mask=inside)


def scatter(
    base: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, bounds: torch.Tensor, shift: torch.Tensor
) -> None:
    """Write ``values`` at ``positions`` (int64, ascending) of the payload: position ``p`` of part ``j`` (``bounds[j]
    <= p < bounds[j + 1]``) to unit ``p + shift[j]`` counted from ``base``'s first."""
    n, parts = positions.numel(), shift.numel()
    if n:
        _scatter_kernel[(triton.cdiv(n, BLOCK),)](
            base, positions, values, bounds, shift, n, parts, max(parts - 1, 1).bit_length(), BLOCK=BLOCK
        )


def warm(device: torch.device | str) -> None:
    """Compile the kernel for every word type (one compilation serves any pull: sizes are not specialized)."""
    for unit in (torch.int16, torch.uint8):
        base = torch.zeros(8, dtype=unit, device=device)
        bounds = torch.tensor([0, 4, 8], dtype=torch.int64, device=device)
        positions = torch.arange(8, dtype=torch.int64, device=device)
        scatter(
            base,
            positions,
            torch.ones(8, dtype=unit, device=device),
            bounds,
            torch.zeros(2, dtype=torch.int64, device=device),
        )
