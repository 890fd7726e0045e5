"""Block FP8: float8_e4m3fn weights with one float32 ``weight_scale_inv`` per 128x128 block.

The format is the one DeepSeek-V3, Kimi K2 and Qwen3-*-FP8 checkpoints ship and vLLM's block-FP8 linear method
holds: a weight ``W`` of shape ``(..., R, C)`` becomes ``weight`` (float8_e4m3fn, same shape) and
``weight_scale_inv`` (float32, ``(..., ceil(R/128), ceil(C/128))``). Block ``(i, j)`` is rows
``[128 i, 128 i + 128)`` and columns ``[128 j, 128 j + 128)`` clipped to the matrix (edge blocks are partial), and
dequantizes as ``W[block] ~= weight[block].float() * weight_scale_inv[i, j]``. Leading dims (the experts of a
fused ``w13``/``w2``) are independent matrices: blocks never span two experts.

The quantizer, exactly (every backend computes these bits; see docs/notes/fp8.md):

1. ``x = W.float()`` (exact for bf16, fp16 and float32 inputs);
2. ``amax = max |x|`` over the block's existing elements (DeepSeek's zero padding of edge blocks leaves it equal);
3. ``scale_inv = amax / 448`` as one IEEE float32 division (round to nearest even), or ``1.0`` where ``amax == 0``;
4. ``weight = e4m3fn(clamp(x / scale_inv, -448, 448))``: one IEEE float32 division per element, then rounding to
   nearest even onto e4m3fn. The clamp only catches ``x / scale_inv`` landing one float32 step above 448 at the
   block's maximum (both the torch conversion and a saturating hardware conversion would give 448 there).

Because a block's result depends on that block's elements alone, quantizing a *block-aligned* box of a tensor
(:func:`block_aligned`) gives exactly the corresponding box of quantizing the whole tensor; a box that cuts
through blocks does not (its edge blocks have other elements, so other maxima). A non-finite input makes its
block's scale non-finite; kvmove.quant.quantizer.quantize refuses it, since those bits are not portable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvmove.errors import KvmoveError

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn value (``torch.finfo(torch.float8_e4m3fn).max``)."""


class BlockQuantized(NamedTuple):
    """One tensor in block FP8: ``weight`` (e4m3fn) and ``scale_inv`` (float32, one per block)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor


class BlockBox(NamedTuple):
    """A box of a tensor, ``start[d] <= i_d < stop[d]`` (same fields as kvmove.sync.planning.plan.Box)."""

    start: tuple[int, ...]
    stop: tuple[int, ...]


class NonFiniteWeightError(KvmoveError):
    """A weight to quantize holds inf or NaN (its block scale would not be finite)."""


def scale_shape(shape: Sequence[int], block: int = BLOCK) -> tuple[int, ...]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape``: the last two dims counted in blocks."""
    if len(shape) < 2:
        raise ValueError(f"block quantization needs a matrix (or a stack of them), got shape {tuple(shape)}")
    *lead, rows, cols = shape
    return (*lead, -(-rows // block), -(-cols // block))


def quantize_torch(x: torch.Tensor, block: int = BLOCK) -> BlockQuantized:
    """The quantizer in whole-tensor torch ops (CPU or CUDA): pad to whole blocks, reduce, divide, cast."""
    *lead, rows, cols = x.shape
    brows, bcols = scale_shape(x.shape, block)[-2:]
    xf = x.float()
    if rows % block or cols % block:
        xf = F.pad(xf, (0, bcols * block - cols, 0, brows * block - rows))  # zeros leave every |max| unchanged
    tiles = xf.reshape(*lead, brows, block, bcols, block)
    amax = tiles.abs().amax(dim=(-3, -1))
    # NOTE: divide by a tensor, not a Python scalar: CUDA turns `t / scalar` into `t * (1 / scalar)`, which is
    # not the IEEE division (1/448 is inexact) and changes the last bit of some scales against the CPU.
    scale_inv = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX))
    q = (tiles / scale_inv[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, brows * block, bcols * block)[..., :rows, :cols]
    return BlockQuantized(q.contiguous(), scale_inv)


def dequantize(q: BlockQuantized, *, block: int = BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight * scale_inv`` broadcast over each block (what an engine's bf16 fallback GEMM computes)."""
    rows, cols = q.weight.shape[-2:]
    scale = q.scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :rows, :cols]
    return (q.weight.float() * scale).to(dtype)


def block_aligned(start: Sequence[int], stop: Sequence[int], shape: Sequence[int], block: int = BLOCK) -> bool:
    """Whether the box ``[start, stop)`` of a ``shape`` tensor consists of whole blocks.

    Then quantizing the box alone equals the box of the quantized whole, bit for bit (and its scales are the
    ``scale_box`` of the whole's). Leading (expert) dims never matter; in the last two dims each edge must lie
    on a block boundary or at the end of the tensor.
    """
    for a, b, n in zip(start[-2:], stop[-2:], shape[-2:], strict=True):
        if a % block or (b % block and b != n):
            return False
    return True


def covering_blocks(start: Sequence[int], stop: Sequence[int], shape: Sequence[int], block: int = BLOCK) -> BlockBox:
    """The smallest block-aligned box holding ``[start, stop)``: what must be read to quantize that box."""
    lead = len(shape) - 2
    lo = [*start[:lead], *(a - a % block for a in start[lead:])]
    hi = [*stop[:lead], *(min(-(-b // block) * block, n) for b, n in zip(stop[lead:], shape[lead:], strict=True))]
    return BlockBox(tuple(lo), tuple(hi))


def scale_box(start: Sequence[int], stop: Sequence[int], block: int = BLOCK) -> BlockBox:
    """The entries of ``weight_scale_inv`` whose blocks meet the weight box ``[start, stop)``."""
    lead = len(start) - 2
    lo = [*start[:lead], *(a // block for a in start[lead:])]
    hi = [*stop[:lead], *(-(-b // block) for b in stop[lead:])]
    return BlockBox(tuple(lo), tuple(hi))


def scale_to_weight_box(
    start: Sequence[int], stop: Sequence[int], shape: Sequence[int], block: int = BLOCK
) -> BlockBox:
    """The weight box (of a ``shape`` weight) whose blocks are the scale entries ``[start, stop)``."""
    lead = len(shape) - 2
    lo = [*start[:lead], *(a * block for a in start[lead:])]
    hi = [*stop[:lead], *(min(b * block, n) for b, n in zip(stop[lead:], shape[lead:], strict=True))]
    return BlockBox(tuple(lo), tuple(hi))
