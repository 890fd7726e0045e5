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

from kvmove.quant import BLOCK, FP8_DTYPE, FP8_MAX
from kvmove.quant.fp8 import quantize_torch
from kvmove.quant.triton_fp8 import quantize_triton


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = a.dtype == b.dtype and a.shape == b.shape
    return same and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def weights(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(4)).to(torch.bfloat16)


def ties() -> torch.Tensor:
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()
    mids = (codes[:-1] + codes[1:]) / 2
    x = torch.zeros(BLOCK, BLOCK)
    x.view(-1)[: 2 * mids.numel()] = torch.cat([mids, -mids])
    x[-1, -1] = FP8_MAX
    return x.to(torch.bfloat16)


def extremes() -> torch.Tensor:
    x = weights(256, 384, seed=5)
    x[:128, :128] *= 1e-30
    x[128:, :128] *= 1e30
    x[:128, 128:256] = -0.0
    return x


@pytest.mark.parametrize(
    "x",
    [
        weights(128, 128),
        weights(200, 130),
        weights(1, 5),
        weights(3, 130, 260),
        ties(),
        extremes(),
        weights(384, 256).t(),
    ],
    ids=["one-block", "edges", "tiny", "experts", "ties", "extremes", "strided"],
)
def test_interpreted_kernel_equals_torch(x: torch.Tensor) -> None:
    want, got = quantize_torch(x), quantize_triton(x, BLOCK)
    assert same_bits(got.weight, want.weight)
    assert same_bits(got.scale_inv, want.scale_inv)


def test_nan_block_gets_a_non_finite_scale() -> None:
    x = weights(128, 256)
    x[5, 200] = float("nan")
    s = quantize_triton(x, BLOCK).scale_inv
    assert bool(torch.isfinite(s[0, 0])) and not bool(torch.isfinite(s[0, 1]))
