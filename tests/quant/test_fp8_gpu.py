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
