"""On a GPU: the Triton kernel and torch-on-CUDA give the CPU torch path's bits, exactly.

Run on the GPU machine with ``pytest -q -m gpu tests/quant`` (needs torch with CUDA and triton; no Ray).
"""

from __future__ import annotations

import pytest
import torch

from kvmove.quant import BLOCK, FP8_DTYPE, FP8_MAX, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(128, 128), (256, 384), (200, 130), (1, 5), (1536, 4096), (4096, 1536), (576, 7168), (3, 130, 260)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))
    )


def weights(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(4)).to(torch.bfloat16)


def fp8_midpoints() -> torch.Tensor:
    """Every positive midpoint between adjacent finite e4m3fn values (all rounding ties), and their negatives."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448, ascending
    mids = (codes[:-1] + codes[1:]) / 2
    return torch.cat([mids, -mids])


def backends(x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {"cpu": quantize(x, backend="torch"), "cuda-torch": quantize(x.cuda(), backend="torch")}
    pytest.importorskip("triton")
    out["triton"] = quantize(x.cuda(), backend="triton")
    return out


def assert_all_equal(x: torch.Tensor) -> None:
    got = backends(x)
    ref = got.pop("cpu")
    for name, q in got.items():
        assert same_bits(q.weight, ref.weight), f"{name}: weights differ from the CPU torch path"
        assert same_bits(q.scale_inv, ref.scale_inv), f"{name}: scales differ from the CPU torch path"


@pytest.mark.parametrize("shape", SHAPES)
def test_backends_agree_on_random_weights(shape: tuple[int, ...]) -> None:
    assert_all_equal(weights(*shape, seed=len(shape)))


def test_backends_agree_on_every_rounding_tie() -> None:
    """A block whose max is 448 has scale 1, so its elements hit every e4m3 tie exactly (bf16 holds them)."""
    mids = fp8_midpoints()
    x = torch.zeros(BLOCK, BLOCK)
    x.view(-1)[: mids.numel()] = mids
    x[-1, -1] = FP8_MAX
    assert_all_equal(x.to(torch.bfloat16))


def test_backends_agree_on_tiny_and_huge_blocks() -> None:
    x = weights(512, 512)
    x[:128, :128] *= 1e-30  # fp8 subnormals after scaling, tiny scales
    x[128:256, :128] *= 1e30
    x[256:384, :128] = 0
    x[384:, :128] = -0.0
    assert_all_equal(x)


def test_triton_reads_strided_inputs() -> None:
    pytest.importorskip("triton")
    x = weights(384, 640).cuda()
    assert same_bits(quantize(x.t(), backend="triton").weight, quantize(x.t().contiguous(), backend="torch").weight)
