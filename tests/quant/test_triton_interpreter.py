"""The Triton kernel's arithmetic on CPU, run by Triton's interpreter: the same bits as the torch path.

Runs where triton is installed and no GPU is (``pip install triton``; not part of kvmove's dev environment); on
a GPU machine tests/quant/test_fp8_gpu.py runs the compiled kernel instead.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a GPU runs the compiled kernel (test_fp8_gpu.py)", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (its CPU interpreter runs this test)")

from kvmove.quant import BLOCK
from kvmove.quant.check import CASES, same_bits
from kvmove.quant.fp8 import quantize_torch
from kvmove.quant.triton_fp8 import quantize_triton


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_equals_torch(case: str) -> None:
    x = CASES[case]()
    assert same_bits(quantize_triton(x, BLOCK), quantize_torch(x))


def test_nan_block_gets_a_non_finite_scale() -> None:
    x = CASES["one-block"]().repeat(1, 2)
    x[5, 200] = float("nan")
    s = quantize_triton(x, BLOCK).scale_inv
    assert bool(torch.isfinite(s[0, 0])) and not bool(torch.isfinite(s[0, 1]))


def test_interpreted_kernel_writes_into_strided_views_of_a_slot() -> None:
    from kvmove.quant.triton_fp8 import quantize_triton_into

    x = torch.randn(3, 256, 320, dtype=torch.bfloat16)
    step = 256 * 320 + 48 + 16 * 4  # each matrix's weight, then its scales, then padding, in one byte slot
    slot = torch.zeros(3 * step, dtype=torch.uint8)
    weight = slot.as_strided((3, 256, 320), (step, 320, 1)).view(torch.float8_e4m3fn)
    scale = slot[256 * 320 :].view(torch.float32).as_strided((3, 2, 3), (step // 4, 3, 1))
    quantize_triton_into(x, weight, scale, BLOCK)
    want = quantize_torch(x)
    assert torch.equal(weight.view(torch.uint8), want.weight.view(torch.uint8)) and torch.equal(scale, want.scale_inv)
