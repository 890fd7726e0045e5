"""The quantizer micro-benchmark: GB/s of each backend and Triton variant on the layouts sync plans quantize,
against the device-copy rate measured in the same run (bytes read plus bytes written, both).

A layout is a BF16 view as pull programs hand it to the quantizer: a stack of experts back to back, every other
expert of an arena (gate and up interleaved), a column slice (rows longer than the matrix), a row slice, one
matrix, and a transposed view. Quantizing moves 2 bytes in and 1 byte out per weight (plus a 4-byte scale per
16,384 weights), so ``rw_gbps`` counts those and ``fraction_of_copy`` divides it by the copy's rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kvmove.quant.fp8 import BLOCK, FP8_DTYPE, scale_shape

LAYOUTS: dict[str, Callable[[str], torch.Tensor]] = {
    "experts": lambda d: torch.randn(128, 3072, 4096, device=d, dtype=torch.bfloat16),
    "interleaved-experts": lambda d: torch.randn(64, 2, 1536, 4096, device=d, dtype=torch.bfloat16)[:, 0],
    "column-slice": lambda d: torch.randn(16384, 12288, device=d, dtype=torch.bfloat16)[:, 4096:12288],
    "row-slice": lambda d: torch.randn(24576, 8192, device=d, dtype=torch.bfloat16)[8192:24576],
    "matrix": lambda d: torch.randn(16384, 16384, device=d, dtype=torch.bfloat16),
    "transposed": lambda d: torch.randn(16384, 8192, device=d, dtype=torch.bfloat16).t(),
}
"""BF16 inputs of 0.4-3.2 GB (several times the L2), by the shape a plan gives the quantizer."""


class Throughput(NamedTuple):
    backend: str
    device: str
    shape: tuple[int, ...]
    seconds: float
    gbps: float
    """BF16 bytes read per second."""
    layout: str = "experts"
    variant: str = ""
    rw_gbps: float = 0.0
    """Bytes read plus bytes written (BF16 in, FP8 and scales out) per second."""
    fraction_of_copy: float = 0.0
    """``rw_gbps`` over the same run's device-copy rate (read plus written)."""


def median_seconds(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median of ``repeats`` timed calls (CUDA events), after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_gbps(nbytes: int = 1 << 32, device: str = "cuda") -> float:
    """The device-to-device copy rate, bytes read plus written per second (a 4 GiB copy by default)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src))
    return 2 * nbytes / seconds / 1e9


def _moved_bytes(x: torch.Tensor) -> int:
    return x.numel() * (x.element_size() + 1) + 4 * int(torch.Size(scale_shape(x.shape)).numel())


def measure_layout(layout: str, x: torch.Tensor, copy: float, variants: list[str], torch_too: bool) -> list[Throughput]:
    """Each Triton variant (and the torch path if ``torch_too``) on ``x``, into preallocated outputs."""
    from kvmove.quant.fp8 import quantize_torch
    from kvmove.quant.triton_fp8 import quantize_triton_into

    mats = x.reshape(-1, *x.shape[-2:]) if x.dim() > 2 else x.unsqueeze(0)
    weight = torch.empty(mats.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(scale_shape(mats.shape), dtype=torch.float32, device=x.device)

    def triton_run(variant: str) -> Callable[[], object]:
        return lambda: quantize_triton_into(mats, weight, scale, BLOCK, variant)

    runs: list[tuple[str, str, Callable[[], object]]] = [("triton", v, triton_run(v)) for v in variants]
    if torch_too:
        runs.append(("torch", "", lambda: quantize_torch(x)))
    rows = []
    for backend, variant, fn in runs:
        seconds = median_seconds(fn)
        rw = _moved_bytes(x) / seconds / 1e9
        gbps = x.numel() * x.element_size() / seconds / 1e9
        rows.append(Throughput(backend, "cuda", tuple(x.shape), seconds, gbps, layout, variant, rw, rw / copy))
    return rows


class Speeds(NamedTuple):
    """The device-copy rate of the same run (GB/s, read + written) and each backend's throughput."""

    copy_gbps: float
    throughput: list[Throughput]


def measure(
    layouts: list[str] | None = None, variants: list[str] | None = None, sweep_layout: str = "experts"
) -> Speeds:
    """The copy rate, then the default variant on every layout, every variant (and torch) on ``sweep_layout``."""
    if not torch.cuda.is_available():
        return Speeds(0.0, [])
    from kvmove.quant.triton_fp8 import VARIANTS, default_variant

    copy = copy_gbps()
    rows = []
    for layout in layouts if layouts is not None else list(LAYOUTS):
        x = LAYOUTS[layout]("cuda")
        sweep = layout == sweep_layout
        chosen = (variants if variants is not None else list(VARIANTS)) if sweep else [default_variant()]
        rows += measure_layout(layout, x, copy, chosen, torch_too=sweep)
        del x
        torch.cuda.empty_cache()
    return Speeds(copy, rows)
