"""On a GPU: torch-on-CUDA and every Triton variant give the CPU torch path's bits on every check case, and the
fast variant's two shortcuts (Markstein division, the hardware e4m3 conversion) are proven exact exhaustively.

``python -m kvmove.quant`` runs the same checks without pytest (and times the backends).
"""

from __future__ import annotations

import pytest
import torch

from kvmove.quant import BLOCK, NonFiniteWeightError, quantize
from kvmove.quant.check import CASES, available_backends, check_backends, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_every_backend_and_variant_gives_the_cpu_bits() -> None:
    assert ("triton", "cuda") in available_backends(), "triton is not installed"
    checks = check_backends()
    assert {c.backend for c in checks} >= {"torch", "triton:fast", "triton:exact-int", "triton:markstein-int"}
    bad = [c for c in checks if not c.equal]
    assert not bad, bad


@pytest.mark.parametrize("case", list(CASES))
def test_triton_case(case: str) -> None:
    x = CASES[case]()
    assert same_bits(quantize(x.cuda(), backend="triton"), quantize(x, backend="torch"))


def test_hardware_conversion_equals_integer_rounding_on_every_float32_up_to_448() -> None:
    from kvmove.quant.exhaustive import conversion_mismatches

    proof = conversion_mismatches()
    assert proof.cases > 2_000_000_000 and proof.mismatches == 0, proof


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_markstein_quotient_is_exact_for_every_16_bit_element_and_block_max(dtype: torch.dtype) -> None:
    from kvmove.quant.exhaustive import division_mismatches

    proof = division_mismatches(dtype)
    assert proof.cases > 900_000_000 and proof.mismatches == 0, proof


@pytest.mark.parametrize("seed", range(3))
def test_fast_equals_exact_on_large_random_float32_blocks(seed: int) -> None:
    from kvmove.quant.triton_fp8 import quantize_triton

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, 1024, 1024, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-90, 90, (64, 1, 1), device="cuda", generator=g).float())  # scales far apart
    assert same_bits(quantize_triton(x, BLOCK, "fast"), quantize_triton(x, BLOCK, "exact-int"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_blocks_are_refused_on_every_cuda_backend(bad: float) -> None:
    x = CASES["one-block"]().repeat(1, 2).cuda()
    x[5, 200] = bad
    for backend in ("torch", "triton"):
        with pytest.raises(NonFiniteWeightError):
            quantize(x, backend=backend)


def test_batched_triton_stacks_give_the_cpu_bits() -> None:
    from kvmove.quant.batch import quantize_many

    arena = torch.randn(6 * 256 * 320, dtype=torch.bfloat16)
    experts = [arena[i * 256 * 320 : (i + 1) * 256 * 320].view(256, 320) for i in range(6)]
    on_gpu = arena.cuda()
    got = quantize_many([on_gpu[i * 256 * 320 : (i + 1) * 256 * 320].view(256, 320) for i in range(6)])
    for q, x in zip(got, experts, strict=True):
        assert same_bits(q, quantize(x, backend="torch"))


def test_quantize_into_strided_slot_views_gives_the_cpu_bits() -> None:
    from kvmove.quant.quantizer import quantize_into

    x = torch.randn(3, 256, 320, dtype=torch.bfloat16)
    step = 256 * 320 + 48 + 16 * 4
    slot = torch.zeros(3 * step, dtype=torch.uint8, device="cuda")
    weight = slot.as_strided((3, 256, 320), (step, 320, 1)).view(torch.float8_e4m3fn)
    scale = slot[256 * 320 :].view(torch.float32).as_strided((3, 2, 3), (step // 4, 3, 1))
    quantize_into(x.cuda(), weight, scale, backend="triton")
    want = quantize(x, backend="torch")
    assert torch.equal(weight.view(torch.uint8).cpu(), want.weight.view(torch.uint8))
    assert torch.equal(scale.cpu(), want.scale_inv)
