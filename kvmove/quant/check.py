"""Cross-backend check of the block-FP8 quantizer: the same bits from every backend on hard inputs, and speed.

``python -m kvmove.quant`` runs it (on a GPU machine: CPU torch vs CUDA torch vs Triton; no Ray, no pytest) and
prints one JSON object; ``tests/quant`` runs the same cases.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvmove.quant.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, BlockQuantized
from kvmove.quant.quantizer import QUANTIZERS, quantize, triton_available


def random_weights(*shape: int, seed: int = 0) -> torch.Tensor:
    """BF16 weights whose blocks have uneven maxima (a product of a normal and a skewed uniform)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(4)).to(torch.bfloat16)


def rounding_ties() -> torch.Tensor:
    """One block with max 448 (scale 1) holding every midpoint of adjacent e4m3 values, positive and negative."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()
    mids = (codes[:-1] + codes[1:]) / 2
    x = torch.zeros(BLOCK, BLOCK)
    x.view(-1)[: 2 * mids.numel()] = torch.cat([mids, -mids])
    x[-1, -1] = FP8_MAX
    return x.to(torch.bfloat16)


def extreme_blocks() -> torch.Tensor:
    """Blocks of tiny values (fp8 subnormals after scaling), huge values, zeros and negative zeros."""
    x = random_weights(512, 384, seed=5)
    x[:128, :128] *= 1e-30
    x[128:256, :128] *= 1e30
    x[256:384, :128] = 0
    x[384:, :128] = -0.0
    return x


CASES: dict[str, Callable[[], torch.Tensor]] = {
    "one-block": lambda: random_weights(128, 128),
    "partial-edges": lambda: random_weights(200, 130, seed=1),
    "tiny": lambda: random_weights(1, 5, seed=2),
    "kv_a-576x7168": lambda: random_weights(576, 7168, seed=3),
    "expert-stack": lambda: random_weights(3, 130, 260, seed=4),
    "ties": rounding_ties,
    "extremes": extreme_blocks,
    "strided": lambda: random_weights(384, 640, seed=6).t(),
}
"""Inputs every backend must quantize to the same bits."""


def same_bits(a: BlockQuantized, b: BlockQuantized) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(raw(x), raw(y))
        for x, y in ((a.weight, b.weight), (a.scale_inv, b.scale_inv))
    )


class BackendCheck(NamedTuple):
    case: str
    backend: str
    device: str
    equal: bool


def available_backends() -> list[tuple[str, str]]:
    """(backend, device) pairs this machine can run: torch on CPU always, torch and Triton on CUDA if present."""
    out = [("torch", "cpu")]
    if torch.cuda.is_available():
        out.append(("torch", "cuda"))
        if triton_available():
            out.append(("triton", "cuda"))
    return out


def check_backends() -> list[BackendCheck]:
    """Every case on every available backend, compared with the CPU torch path."""
    rows = []
    for case, make in CASES.items():
        x = make()
        want = quantize(x, backend="torch")
        for backend, device in available_backends()[1:]:
            got = quantize(x.to(device), backend=backend)
            rows.append(BackendCheck(case, backend, device, same_bits(got, want)))
    return rows


class Throughput(NamedTuple):
    backend: str
    device: str
    shape: tuple[int, ...]
    seconds: float
    gbps: float
    """BF16 bytes read per second."""


def measure(shape: tuple[int, ...] = (128, 3072, 4096), repeats: int = 5) -> list[Throughput]:
    """Time each CUDA backend on one BF16 tensor (default: one Qwen3-235B-A22B layer's fused w13, 3.2 GB)."""
    if not torch.cuda.is_available():
        return []
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    rows = []
    for backend, device in available_backends()[1:]:
        QUANTIZERS[backend](x, BLOCK)  # compile / warm up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            QUANTIZERS[backend](x, BLOCK)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / repeats
        rows.append(Throughput(backend, device, shape, seconds, x.numel() * 2 / seconds / 1e9))
    return rows
