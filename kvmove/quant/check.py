"""Cross-backend check of the block-FP8 quantizer: the same bits from every backend on hard inputs, and speed.

``kvmove check quant`` (or ``python -m kvmove.quant``, a thin call into it) runs it (on a GPU machine: CPU torch vs
CUDA torch vs Triton; no Ray, no pytest) and prints one JSON object; ``tests/quant`` runs the same cases.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvmove.quant.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, BlockQuantized
from kvmove.quant.quantizer import quantize, triton_available


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


def fp8_subnormals() -> torch.Tensor:
    """Blocks of scale 1 (max 448) holding every bf16 value of magnitude below 2**-5, either sign: e4m3's
    subnormals (multiples of 2**-9 under 2**-6), the ties between them, and what rounds to zero."""
    bits = torch.arange(0, 0x3D00, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = torch.cat([bits, -bits])
    x = torch.zeros(-(-vals.numel() // (BLOCK * BLOCK)) * BLOCK, BLOCK)
    x.view(-1)[: vals.numel()] = vals
    x[::BLOCK, -1] = FP8_MAX
    return x.to(torch.bfloat16)


def saturation_blocks() -> torch.Tensor:
    """Blocks whose max is exactly +-448 (scale 1), just above it (449, 464, 480: scale above 1), and bf16
    subnormal inputs (scale far below 2**-80: the exact-division branch) next to a normal block."""
    x = random_weights(256, 640, seed=7)
    x[:128, :128] = x[:128, :128].clamp(-1, 1) * 448
    x[0, 0], x[1, 1] = 448.0, -448.0
    x[128:, :128] = -448.0
    for j, top in enumerate((449.0, 464.0, 480.0)):
        x[:128, 128 * (j + 1) : 128 * (j + 2)] *= top / x[:128, 128 * (j + 1) : 128 * (j + 2)].abs().max()
    x[128:, 128:256] = random_weights(128, 128, seed=8) * 1e-38  # bf16 subnormals
    x[128:, 256:384] = random_weights(128, 128, seed=9) * 1e-38
    x[128, 256] = 1.0  # a normal block max beside subnormal elements
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
    "fp8-subnormals": fp8_subnormals,
    "saturation": saturation_blocks,
    "all-zero": lambda: torch.zeros(256, 384, dtype=torch.bfloat16),
    "fp16-input": lambda: random_weights(256, 384, seed=10).to(torch.float16),
    "fp32-input": lambda: torch.randn(256, 384, generator=torch.Generator().manual_seed(11)) * 3,
    "column-slice": lambda: random_weights(256, 640, seed=12)[:, 128:512],
    "interleaved-stack": lambda: random_weights(4, 2, 128, 256, seed=13)[:, 1],
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


def triton_variants() -> list[str]:
    """The Triton variants this process can run: all on a GPU; under the interpreter those rounding in integers."""
    from kvmove.quant.triton_fp8 import VARIANTS

    if os.environ.get("TRITON_INTERPRET") == "1":
        return [name for name, v in VARIANTS.items() if v.rounding == "int"]
    return list(VARIANTS) if torch.cuda.is_available() else []


def check_backends() -> list[BackendCheck]:
    """Every case on every available backend (each Triton variant apart: ``triton:<variant>``), compared with the
    CPU torch path."""
    rows = []
    for case, make in CASES.items():
        x = make()
        want = quantize(x, backend="torch")
        for backend, device in available_backends()[1:]:
            if backend != "triton":
                got = quantize(x.to(device), backend=backend)
                rows.append(BackendCheck(case, backend, device, same_bits(got, want)))
                continue
            from kvmove.quant.triton_fp8 import quantize_triton

            for variant in triton_variants():
                got = quantize_triton(x.to(device), BLOCK, variant)
                rows.append(BackendCheck(case, f"triton:{variant}", device, same_bits(got, want)))
    return rows


class QuantReport(NamedTuple):
    """``kvmove check quant``: every comparison with the CPU bits, the fast variant's proofs (on a GPU) and speeds."""

    torch: str
    device: str
    backends: list[str]
    checks: list[dict[str, object]]
    all_equal: bool
    proofs: list[dict[str, object]]
    proven: bool
    copy_gbps: float
    """The same run's device-copy rate (GB/s read + written); 0 without a GPU."""
    throughput: list[dict[str, object]]
    """Each backend and variant's GB/s and fraction of ``copy_gbps`` (``kvmove.quant.speed.Throughput``)."""

    @property
    def ok(self) -> bool:
        return self.all_equal and self.proven


def report() -> QuantReport:
    """The whole check: every backend and variant against the CPU bits, on a GPU the exhaustive proofs of the fast
    Triton variant's shortcuts, and the quantizer's GB/s against the same run's device-copy rate."""
    from kvmove.quant.speed import measure

    checks = check_backends()
    proofs = []
    if torch.cuda.is_available() and ("triton", "cuda") in available_backends():
        from kvmove.quant.exhaustive import prove_all

        proofs = [p._asdict() for p in prove_all()]
    copy, throughput = measure()
    return QuantReport(
        torch.__version__,
        torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        [f"{b}/{d}" for b, d in available_backends()],
        [c._asdict() for c in checks],
        all(c.equal for c in checks),
        proofs,
        all(p["mismatches"] == 0 for p in proofs),
        copy,
        [t._asdict() for t in throughput],
    )
