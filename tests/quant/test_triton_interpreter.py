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
