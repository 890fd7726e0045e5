"""The block-FP8 quantizer as one Triton kernel (CUDA): one program per 128x128 block of one matrix.

It computes the bits kvmove.quant.fp8 specifies with the same float32 operations in the same order: load as
float32, ``max |x|`` over the block, ``scale_inv = amax / 448`` and ``x / scale_inv`` as IEEE divisions
(``tl.div_rn``: Triton's plain ``/`` may lower to an approximate division), clamp to +-448. The last step,
rounding to nearest even onto e4m3fn, is done in exact integer arithmetic rather than by the hardware
conversion: ``|y| * 2**(3 - e)`` (``e`` = the binade of ``|y|``, at least -6) is exact in float32, its
round-half-even integer ``n`` (8..16, or 0..8 for subnormals) picks the e4m3 value ``n * 2**(e - 3)``, and the byte
is assembled from ``e``, ``n`` and the sign. So the result depends on no conversion instruction (nor on how a GPU
treats fp8 subnormals), and Triton's CPU interpreter reproduces it too. A block holding NaN gets an infinite
scale, which the caller's finiteness check refuses as the torch path's NaN scale is. Imported lazily: kvmove
works without triton; ``tests/quant`` compares this kernel with the torch path bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmove.quant.fp8 import FP8_DTYPE, FP8_MAX, BlockQuantized, scale_shape

_MAX_GRID_Z = 65535


@triton.jit
def _e4m3_bytes(y):
    """Round float32 ``y`` (|y| <= 448) to nearest even e4m3fn; return its bytes as int32 (0..255)."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    ay = tl.abs(y)
    e = tl.maximum(((ay.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    v = ay * ((130 - e) << 23).to(tl.float32, bitcast=True)  # |y| / 2**(e - 3), exact: in [0, 16]
    t = v.to(tl.int32)  # floor (v >= 0)
    frac = v - t.to(tl.float32)
    n = t + ((frac > 0.5) | ((frac == 0.5) & ((t & 1) == 1))).to(tl.int32)
    code = tl.where(n < 8, n, ((e + 7 + (n >> 4)) << 3) | (n & 7))
    return code | (sign << 7)


@triton.jit
def _block_fp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    stride_m,
    stride_r,
    stride_c,
    q_stride_m,
    q_stride_r,
    s_stride_m,
    s_stride_r,
    BLOCK: tl.constexpr,
    FMAX: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    mat = tl.program_id(2).to(tl.int64)
    r = (pid_r * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    c = (pid_c * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    src = x_ptr + mat * stride_m + r[:, None] * stride_r + c[None, :] * stride_c
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1, keep_dims=True), axis=0, keep_dims=True)
    nan = tl.max(tl.max((x != x).to(tl.int32), axis=1, keep_dims=True), axis=0, keep_dims=True)
    amax = tl.where(nan > 0, float("inf"), amax)
    scale = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, tl.full((1, 1), FMAX, tl.float32)))
    y = tl.div_rn(x, tl.broadcast_to(scale, (BLOCK, BLOCK)))
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    dst = q_ptr + mat * q_stride_m + r[:, None] * q_stride_r + c[None, :]
    tl.store(dst, _e4m3_bytes(y).to(tl.uint8), mask=mask)
    s_off = mat * s_stride_m + pid_r * s_stride_r + pid_c
    tl.store(s_ptr + s_off + tl.zeros((1, 1), dtype=tl.int64), scale)


def quantize_triton(x: torch.Tensor, block: int) -> BlockQuantized:
    """Quantize ``x`` (``(..., R, C)``, any strides) with one kernel launch per 65535 matrices."""
    *lead, rows, cols = x.shape
    brows, bcols = scale_shape(x.shape, block)[-2:]
    mats = x.reshape(-1, rows, cols) if lead else x.unsqueeze(0)
    q = torch.empty(mats.shape, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((mats.shape[0], brows, bcols), dtype=torch.float32, device=x.device)
    quantize_triton_into(mats, q, s, block)
    return BlockQuantized(q.view(*lead, rows, cols), s.view(*lead, brows, bcols))


def quantize_triton_into(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """Quantize the ``(n, R, C)`` stack ``x`` (any strides) into ``weight`` (``(n, R, C)`` FP8 whose rows are
    contiguous) and ``scale`` (``(n, R/block, C/block)`` float32 whose rows are contiguous), both of any matrix
    and row strides: e.g. views of a pull's slot, so the quantized bytes need no further copy."""
    if not x.numel():
        return
    q8 = weight.view(torch.uint8)
    for first in range(0, x.shape[0], _MAX_GRID_Z):
        part = slice(first, first + _MAX_GRID_Z)
        src, qd, sd = x[part], q8[part], scale[part]
        grid = (scale.shape[1], scale.shape[2], src.shape[0])
        _block_fp8_kernel[grid](
            src, qd, sd, x.shape[1], x.shape[2], *src.stride(), *qd.stride()[:2], *sd.stride()[:2],
            BLOCK=block, FMAX=FP8_MAX,
        )  # fmt: skip
