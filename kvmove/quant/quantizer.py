"""``quantize``: one entry point over the block-FP8 backends (torch everywhere, Triton on CUDA), all bit-identical."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.quant.fp8 import BLOCK, BlockQuantized, NonFiniteWeightError, quantize_torch, scale_shape


def _quantize_triton(x: torch.Tensor, block: int) -> BlockQuantized:
    from kvmove.quant.triton_fp8 import quantize_triton

    return quantize_triton(x, block)


QUANTIZERS: dict[str, Callable[[torch.Tensor, int], BlockQuantized]] = {
    "torch": quantize_torch,
    "triton": _quantize_triton,
}
"""Backends of :func:`quantize`; each computes kvmove.quant.fp8's bits (tests/quant compare them on a GPU)."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend(x: torch.Tensor) -> str:
    """Triton for CUDA tensors when it is installed, else torch."""
    return "triton" if x.is_cuda and triton_available() else "torch"


def quantize(
    x: torch.Tensor,
    *,
    block: int = BLOCK,
    backend: str | None = None,
    check_finite: bool = True,
    name: str = "weight",
) -> BlockQuantized:
    """Block-quantize ``x`` (``(..., R, C)``, any float dtype and strides) exactly as kvmove.quant.fp8 specifies.

    ``backend`` picks an entry of QUANTIZERS (default: :func:`default_backend`). With ``check_finite`` a tensor
    holding inf or NaN raises NonFiniteWeightError naming ``name`` (one reduction over the scales).
    """
    scale_shape(x.shape, block)  # refuses vectors
    if not x.is_floating_point():
        raise ValueError(f"cannot quantize {name}: dtype {x.dtype} is not a floating-point type")
    backend = backend or default_backend(x)
    if backend not in QUANTIZERS:
        raise KvmoveError(f"unknown quantizer backend {backend!r} (known: {', '.join(QUANTIZERS)})")
    if backend == "triton" and not x.is_cuda:
        raise KvmoveError(f"the triton quantizer runs on CUDA tensors; {name} is on {x.device}")
    if backend == "triton" and not triton_available():
        raise MissingDependencyError("the triton quantizer needs the `triton` package (pip install triton)")
    out = QUANTIZERS[backend](x, block)
    if check_finite and not bool(torch.isfinite(out.scale_inv).all()):
        bad = int((~torch.isfinite(out.scale_inv)).sum())
        raise NonFiniteWeightError(f"cannot quantize {name}: {bad} of its {block}x{block} blocks hold inf or NaN")
    return out
