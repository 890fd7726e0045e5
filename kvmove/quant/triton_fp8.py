"""The block-FP8 quantizer as one Triton kernel (CUDA): one program per 128x128 block, at memory speed.

It computes the bits kvmove.quant.fp8 specifies. Each program loads its block once (as float32, held in
registers), reduces ``max |x|``, computes ``scale_inv = amax / 448`` (``tl.div_rn``: an IEEE division), and writes
the block's FP8 bytes and its scale straight into the given outputs (views of a slot, of scratch or of an engine's
parameters). Two steps have variants (:class:`Variant`, registry :data:`VARIANTS`), every one of them exact:

- the quotient ``x / scale_inv``: ``div_rn`` per element (IEEE division, a long instruction sequence), or
  ``markstein``: one correctly rounded reciprocal per block, then per element a product and two FMA correction
  steps, which give the correctly rounded quotient wherever no intermediate underflows (Markstein's theorem:
  see docs/notes/fp8.md). Blocks whose scale is below ``2**-80`` (where a remainder could underflow) take the
  ``div_rn`` branch; a zero input keeps its sign.
- the rounding onto e4m3fn: ``int``, exact integer arithmetic (``|y| * 2**(3 - e)`` is exact in float32, its
  round-half-even integer ``n`` picks the e4m3 value ``n * 2**(e - 3)``; the byte is assembled from ``e``, ``n``
  and the sign), which Triton's CPU interpreter reproduces; or ``hw``, the GPU's conversion instruction (on
  sm_89+ ``cvt.rn.satfinite.e4m3x2.f32``: round to nearest even, subnormals kept). The interpreter's own fp8
  conversion does not round to nearest even, so ``hw`` runs on GPUs only, where tests/quant/test_fp8_gpu.py
  proves it equal to ``int`` on every float32 in [-448, 448] (kvmove.quant.exhaustive).

``max |x|`` is reduced over the float32 bits as integers (sign cleared): for non-negative floats integer order is
float order, and every NaN pattern lies above infinity, so a block holding NaN gets a NaN scale (as the torch
path's) and one holding inf an infinite one; the caller's finiteness check refuses both. Imported lazily: kvmove
works without triton.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvmove.quant.fp8 import FP8_DTYPE, FP8_MAX, BlockQuantized, scale_shape

SAFE_SCALE = 2.0**-80
"""Smallest scale for which the ``markstein`` quotient is exact (no remainder underflows); below, ``div_rn``."""


class Variant(NamedTuple):
    """How one kernel build divides and rounds, and its launch shape."""

    division: str
    """``div_rn`` or ``markstein``."""
    rounding: str
    """``int`` (exact integer arithmetic, runs in the interpreter) or ``hw`` (the GPU's conversion instruction)."""
    num_warps: int = 8


VARIANTS: dict[str, Variant] = {
    "fast": Variant("markstein", "hw", 8),
    "markstein-int": Variant("markstein", "int", 8),
    "exact-int": Variant("div_rn", "int", 8),
    "exact-hw": Variant("div_rn", "hw", 8),
    "fast-w4": Variant("markstein", "hw", 4),
    "fast-w16": Variant("markstein", "hw", 16),
}
"""Every variant computes the same bits (tests compare them all). ``fast`` is the default on GPUs; the
interpreter (``TRITON_INTERPRET=1``) runs ``markstein-int``, whose arithmetic ``fast`` shares but for rounding."""


def default_variant() -> str:
    import os

    return "markstein-int" if os.environ.get("TRITON_INTERPRET") == "1" else "fast"


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
def _to_e4m3(y, HW: tl.constexpr):
    """e4m3fn bytes (uint8) of float32 ``y`` (|y| <= 448, or NaN), rounded to nearest even."""
    if HW:
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return _e4m3_bytes(y).to(tl.uint8)


@triton.jit
def _quotient(x, scale, MARKSTEIN: tl.constexpr, SAFE: tl.constexpr):
    """``RN(x / scale)`` for a block ``x`` and its scalar ``scale`` (> 0)."""
    if MARKSTEIN:
        if scale >= SAFE:
            rcp = tl.div_rn(1.0, scale)  # RN(1 / scale): within half an ulp
            q = x * rcp  # within 1.5 ulp of x / scale
            q = tl.fma(tl.fma(-scale, q, x), rcp, q)  # faithful: within one ulp
            q = tl.fma(tl.fma(-scale, q, x), rcp, q)  # exact remainder, so RN(x / scale) (Markstein)
            y = tl.where(x == 0.0, x, q)  # -0 / scale is -0 (the correction would give +0)
        else:
            y = tl.div_rn(x, scale)
    else:
        y = tl.div_rn(x, scale)
    return y


@triton.jit
def _block_fp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    brows,
    bcols,
    stride_m,
    stride_r,
    stride_c,
    q_stride_m,
    q_stride_r,
    s_stride_m,
    s_stride_r,
    BLOCK: tl.constexpr,
    FMAX: tl.constexpr,
    SAFE: tl.constexpr,
    MARKSTEIN: tl.constexpr,
    HW: tl.constexpr,
    EVEN: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_c = pid % bcols  # neighbouring programs take neighbouring blocks of the same rows
    rest = pid // bcols
    pid_r = rest % brows
    mat = (rest // brows).to(tl.int64)
    r = (pid_r * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    c = (pid_c * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    src = x_ptr + mat * stride_m + r[:, None] * stride_r + c[None, :] * stride_c
    dst = q_ptr + mat * q_stride_m + r[:, None] * q_stride_r + c[None, :]
    if EVEN:
        x = tl.load(src).to(tl.float32)
    else:
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, FMAX))
    y = _quotient(x, scale, MARKSTEIN, SAFE)
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    if EVEN:
        tl.store(dst, _to_e4m3(y, HW))
    else:
        tl.store(dst, _to_e4m3(y, HW), mask=mask)
    tl.store(s_ptr + mat * s_stride_m + pid_r * s_stride_r + pid_c, scale)


def quantize_triton(x: torch.Tensor, block: int, variant: str | None = None) -> BlockQuantized:
    """Quantize ``x`` (``(..., R, C)``, any strides) in one kernel launch."""
    *lead, rows, cols = x.shape
    brows, bcols = scale_shape(x.shape, block)[-2:]
    mats = x.reshape(-1, rows, cols) if lead else x.unsqueeze(0)
    q = torch.empty(mats.shape, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((mats.shape[0], brows, bcols), dtype=torch.float32, device=x.device)
    quantize_triton_into(mats, q, s, block, variant)
    return BlockQuantized(q.view(*lead, rows, cols), s.view(*lead, brows, bcols))


def quantize_triton_into(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int, variant: str | None = None
) -> None:
    """Quantize the ``(n, R, C)`` stack ``x`` (any strides) into ``weight`` (``(n, R, C)`` FP8 whose rows are
    contiguous) and ``scale`` (``(n, R/block, C/block)`` float32 whose rows are contiguous), both of any matrix
    and row strides: e.g. views of a pull's slot or an engine's parameters, so the bytes need no further copy."""
    if not x.numel():
        return
    v = VARIANTS[variant or default_variant()]
    n, rows, cols = x.shape
    brows, bcols = scale.shape[1], scale.shape[2]
    q8 = weight.view(torch.uint8)
    even = rows % block == 0 and cols % block == 0
    _block_fp8_kernel[(n * brows * bcols,)](
        x, q8, scale, rows, cols, brows, bcols, *x.stride(), *q8.stride()[:2], *scale.stride()[:2],
        BLOCK=block, FMAX=FP8_MAX, SAFE=SAFE_SCALE, MARKSTEIN=v.division == "markstein", HW=v.rounding == "hw",
        EVEN=even, num_warps=v.num_warps,
    )  # fmt: skip
