"""On a GPU: torch-on-CUDA and the Triton kernel give the CPU torch path's bits on every check case.

``python -m kvmove.quant`` runs the same check without pytest (and times the backends).
"""

from __future__ import annotations

import pytest
import torch

from kvmove.quant import quantize
from kvmove.quant.check import CASES, available_backends, check_backends, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_every_backend_gives_the_cpu_bits() -> None:
    assert ("triton", "cuda") in available_backends(), "triton is not installed"
    bad = [c for c in check_backends() if not c.equal]
    assert not bad, bad


@pytest.mark.parametrize("case", list(CASES))
def test_triton_case(case: str) -> None:
    x = CASES[case]()
    assert same_bits(quantize(x.cuda(), backend="triton"), quantize(x, backend="torch"))


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
