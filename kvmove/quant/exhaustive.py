"""Exhaustive proofs, on a GPU, that the fast Triton variant computes the exact quantizer's bits.

Two facts make the fast kernel (kvmove.quant.triton_fp8, variant ``fast``) equal to the exact one (``exact-int``,
IEEE division and integer rounding, which the interpreter and the GPU tests compare with the torch reference):

- :func:`conversion_mismatches`: the GPU's e4m3 conversion equals the integer rounding on **every** float32 in
  [-448, 448] (about 2.3e9 values: subnormals, ties and both zeros included), the only values it is given;
- :func:`division_mismatches`: for 16-bit inputs (bf16, fp16) an element's byte depends only on the element and its
  block's ``max |x|``, both values of the input dtype, so every pair ``(x, amax)`` with ``|x| <= amax`` (about
  2e9 pairs per dtype) is tried: the Markstein quotient then conversion gives the byte that IEEE division then
  integer rounding gives.

Each returns the number of mismatches (0 proves it on the GPU it ran on). Needs CUDA and triton.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvmove.quant.fp8 import FP8_MAX
from kvmove.quant.triton_fp8 import SAFE_SCALE, _quotient, _to_e4m3

LAST_BITS = 0x43E00000
"""float32 bits of 448: every non-negative float32 up to 448 has bits 0..LAST_BITS."""

CHUNK = 4096


@triton.jit
def _conversion_kernel(count_ptr, last, CHUNK: tl.constexpr):
    bits = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = bits <= last
    y = tl.where(mask, bits, 0).to(tl.int32).to(tl.float32, bitcast=True)
    bad = (_to_e4m3(y, True) != _to_e4m3(y, False)) | (_to_e4m3(-y, True) != _to_e4m3(-y, False))
    tl.atomic_add(count_ptr, tl.sum((bad & mask).to(tl.int64)))


@triton.jit
def _division_kernel(count_ptr, values_ptr, n, FMAX: tl.constexpr, SAFE: tl.constexpr, CHUNK: tl.constexpr):
    amax = tl.load(values_ptr + tl.program_id(0))  # one positive finite value: the block's max |x|
    scale = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, FMAX))
    bad = tl.zeros((CHUNK,), tl.int64)
    for first in range(0, n, CHUNK):
        idx = first + tl.arange(0, CHUNK)
        x = tl.load(values_ptr + idx, mask=idx < n, other=0.0)
        for sign in tl.static_range(2):
            xs = x if sign == 0 else -x
            fast = _to_e4m3(tl.minimum(tl.maximum(_quotient(xs, scale, True, SAFE), -FMAX), FMAX), True)
            exact = _to_e4m3(tl.minimum(tl.maximum(tl.div_rn(xs, scale), -FMAX), FMAX), False)
            bad += ((fast != exact) & (x <= amax) & (idx < n)).to(tl.int64)
    tl.atomic_add(count_ptr, tl.sum(bad))


class Proof(NamedTuple):
    name: str
    cases: int
    mismatches: int


def conversion_mismatches(device: str = "cuda") -> Proof:
    """The ``hw`` rounding against the ``int`` one on every float32 in [-448, 448]."""
    count = torch.zeros(1, dtype=torch.int64, device=device)
    _conversion_kernel[(LAST_BITS // CHUNK + 1,)](count, LAST_BITS, CHUNK=CHUNK)
    return Proof("e4m3 conversion, every float32 in [-448, 448]", 2 * (LAST_BITS + 1), int(count.item()))


def finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every non-negative finite value of a 16-bit float dtype, ascending, as float32."""
    bits = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    return bits[torch.isfinite(bits)]


def division_mismatches(dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> Proof:
    """The ``fast`` quotient and rounding against IEEE division and integer rounding, for every element and block
    max of ``dtype`` (bf16 or fp16; negative elements too)."""
    values = finite_values(dtype).to(device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    _division_kernel[(values.numel(),)](count, values, values.numel(), FMAX=FP8_MAX, SAFE=SAFE_SCALE, CHUNK=CHUNK)
    n = values.numel()
    return Proof(f"markstein quotient, every {dtype} element and block max", n * (n + 1), int(count.item()))


def prove_all(device: str = "cuda") -> list[Proof]:
    return [
        conversion_mismatches(device),
        division_mismatches(torch.bfloat16, device),
        division_mismatches(torch.float16, device),
    ]
