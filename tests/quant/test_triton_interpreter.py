"""The Triton kernel's arithmetic on CPU, run by Triton's interpreter: the same bits as the torch path, for every
variant the interpreter can run (those rounding in integers; the GPU's conversion instruction, variant ``hw``, is
proven equal to that rounding on every float32 it is given by tests/quant/test_fp8_gpu.py).

Runs where triton is installed and no GPU is (``pip install triton``; not part of kvmove's dev environment); on
a GPU machine tests/quant/test_fp8_gpu.py runs the compiled kernels instead.
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

from kvmove.quant import BLOCK, NonFiniteWeightError
from kvmove.quant.check import CASES, same_bits, triton_variants
from kvmove.quant.fp8 import quantize_torch
from kvmove.quant.triton_fp8 import VARIANTS, quantize_triton, quantize_triton_into

INTERPRETED = triton_variants()


def interpreter_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 where it holds 16-bit subnormals: the interpreter's bf16 -> float32 conversion loses them
    (the compiled kernel's is exact, and the kernel's first step is that conversion, so the arithmetic is the same)."""
    tiny = torch.finfo(x.dtype).tiny
    return x.float() if bool(((x != 0) & (x.abs() < tiny)).any()) else x


def test_the_interpreter_runs_every_integer_rounding_variant() -> None:
    assert [n for n, v in VARIANTS.items() if v.rounding == "int"] == INTERPRETED and len(INTERPRETED) >= 2


@pytest.mark.parametrize("variant", INTERPRETED)
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_equals_torch(case: str, variant: str) -> None:
    x = CASES[case]()
    assert same_bits(quantize_triton(interpreter_input(x), BLOCK, variant), quantize_torch(x))


@pytest.mark.parametrize("variant", INTERPRETED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_block_gets_a_non_finite_scale_and_others_keep_their_bits(variant: str, bad: float) -> None:
    x = CASES["one-block"]().repeat(1, 2)
    x[5, 200] = bad
    got, want = quantize_triton(x, BLOCK, variant), quantize_torch(x)
    assert bool(torch.isfinite(got.scale_inv[0, 0])) and not bool(torch.isfinite(got.scale_inv[0, 1]))
    assert torch.isnan(got.scale_inv[0, 1]) == torch.isnan(want.scale_inv[0, 1])  # NaN -> NaN, inf -> inf
    assert torch.equal(got.scale_inv[0, 0], want.scale_inv[0, 0])
    assert torch.equal(got.weight[:, :128].view(torch.uint8), want.weight[:, :128].view(torch.uint8))


def test_quantize_refuses_non_finite_on_torch() -> None:
    from kvmove.quant import quantize

    x = CASES["one-block"]()
    x[3, 3] = float("nan")
    with pytest.raises(NonFiniteWeightError):
        quantize(x, backend="torch")


@pytest.mark.parametrize("variant", INTERPRETED)
def test_interpreted_kernel_writes_into_strided_views_of_a_slot(variant: str) -> None:
    x = torch.randn(3, 256, 320, dtype=torch.bfloat16)
    step = 256 * 320 + 48 + 16 * 4  # each matrix's weight, then its scales, then padding, in one byte slot
    slot = torch.zeros(3 * step, dtype=torch.uint8)
    weight = slot.as_strided((3, 256, 320), (step, 320, 1)).view(torch.float8_e4m3fn)
    scale = slot[256 * 320 :].view(torch.float32).as_strided((3, 2, 3), (step // 4, 3, 1))
    quantize_triton_into(x, weight, scale, BLOCK, variant)
    want = quantize_torch(x)
    assert torch.equal(weight.view(torch.uint8), want.weight.view(torch.uint8)) and torch.equal(scale, want.scale_inv)
