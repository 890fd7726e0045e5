"""``quantize``: one entry point over the block-FP8 backends (torch everywhere, Triton on CUDA), all bit-identical."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.quant.fp8 import BLOCK, FP8_DTYPE, BlockQuantized, NonFiniteWeightError, quantize_torch, scale_shape


def _quantize_triton(x: torch.Tensor, block: int) -> BlockQuantized:
    from kvmove.quant.triton_fp8 import quantize_triton

    return quantize_triton(x, block)


def _quantize_triton_into(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    from kvmove.quant.triton_fp8 import quantize_triton_into

    quantize_triton_into(x, weight, scale, block)


def _quantize_torch_into(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    q = quantize_torch(x, block)
    weight.copy_(q.weight)
    scale.copy_(q.scale_inv)


QUANTIZERS: dict[str, Callable[[torch.Tensor, int], BlockQuantized]] = {
    "torch": quantize_torch,
    "triton": _quantize_triton,
}
"""Backends of :func:`quantize`; each computes kvmove.quant.fp8's bits (tests/quant compare them on a GPU)."""

QUANTIZERS_INTO: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]] = {
    "torch": _quantize_torch_into,
    "triton": _quantize_triton_into,
}
"""The same backends writing into given tensors (:func:`quantize_into`): Triton writes there, torch copies there."""


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
    backend = _backend(x, backend, name)
    out = QUANTIZERS[backend](x, block)
    if check_finite and not bool(torch.isfinite(out.scale_inv).all()):
        bad = int((~torch.isfinite(out.scale_inv)).sum())
        raise NonFiniteWeightError(f"cannot quantize {name}: {bad} of its {block}x{block} blocks hold inf or NaN")
    return out


def quantize_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: int = BLOCK,
    backend: str | None = None,
    name: str = "weight",
) -> None:
    """:func:`quantize` of the ``(n, R, C)`` stack ``x`` written into ``weight`` (FP8, ``(n, R, C)``) and ``scale``
    (float32, ``(n, ceil(R/block), ceil(C/block))``), views of any matrix and row strides whose rows are
    contiguous (e.g. of a pull's slot). No finiteness check and no host synchronization: the caller checks the
    scales (:func:`non_finite_blocks`) once for many calls."""
    if x.dim() != 3 or weight.shape != x.shape or tuple(scale.shape) != scale_shape(x.shape, block):
        raise ValueError(f"cannot quantize {name} {tuple(x.shape)} into {tuple(weight.shape)}, {tuple(scale.shape)}")
    if weight.dtype != FP8_DTYPE or scale.dtype != torch.float32 or weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"cannot quantize {name} into {weight.dtype}, {scale.dtype} outputs with strided rows")
    QUANTIZERS_INTO[_backend(x, backend, name)](x, weight, scale, block)


def non_finite_blocks(scales: Sequence[torch.Tensor]) -> torch.Tensor:
    """Blocks holding inf or NaN among ``scales`` (quantized scales of them are not finite), as a 0-dim tensor
    on their device: one host synchronization reads it for all of them."""
    if not scales:
        return torch.zeros((), dtype=torch.int64)
    return torch.stack([(~torch.isfinite(s)).sum() for s in scales]).sum()


def _backend(x: torch.Tensor, backend: str | None, name: str) -> str:
    backend = backend or default_backend(x)
    if backend not in QUANTIZERS:
        raise KvmoveError(f"unknown quantizer backend {backend!r} (known: {', '.join(QUANTIZERS)})")
    if backend == "triton" and not x.is_cuda:
        raise KvmoveError(f"the triton quantizer runs on CUDA tensors; {name} is on {x.device}")
    if backend == "triton" and not triton_available():
        raise MissingDependencyError("the triton quantizer needs the `triton` package (pip install triton)")
    return backend
