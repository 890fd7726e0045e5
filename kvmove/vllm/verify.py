"""What a live vLLM model computes with, read back bit-exactly, and the comparison ``--verify`` makes with it.

After vLLM's post-load processing, a parameter is not always what a forward pass uses: on CPU, dense linear
layers keep a 0-element ``weight`` and compute with a oneDNN (or sgl-kernel) packed copy held by a kernel
closure; the tied embedding keeps its ``weight`` for lookups but computes logits through such a copy. Comparing
``named_parameters()`` alone says nothing about those. So every linear-like module (a quant method with
``apply``) is also *read back*: ``apply`` on an identity input returns the transposed weight the kernel holds,
exactly (each output element is one product ``1.0 * w`` plus zeros, accumulated in fp32 and rounded back to
the weight's dtype, which is lossless). The same read-back runs on the engine's own forward path on any device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from kvmove.sync.verify import bits_equal

READ_SUFFIX = ":computed"
"""Key suffix of a module's read-back weight in :func:`computed_state` (``<module>:computed``)."""
_ROWS = 4096
_WIDTHS = ("input_size_per_partition", "input_size", "embedding_dim")


def linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, int]]:
    """(name, module, input width) of every module whose forward is its quant method's ``apply`` (linear
    layers, and embeddings whose method also serves the logits)."""
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, (LinearMethodBase, UnquantizedEmbeddingMethod)):
            continue
        width = next((getattr(module, k) for k in _WIDTHS if isinstance(getattr(module, k, None), int)), None)
        if not isinstance(width, int):
            raise RuntimeError(f"{name}: cannot tell the input width of {type(module).__name__} for its read-back")
        yield name, module, width


@torch.no_grad()
def read_back(module: nn.Module, width: int) -> torch.Tensor:
    """The (output, input) weight ``module``'s kernel computes with: ``apply`` on identity rows (in the dtype
    of ``module.weight``, which processing keeps even where it leaves 0 elements), transposed."""
    method: Any = module.quant_method
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    parts: list[torch.Tensor] = []
    for start in range(0, width, _ROWS):
        rows = torch.eye(width, dtype=weight.dtype, device=weight.device)[start : start + _ROWS]
        parts.append(method.apply(module, rows, bias=None))
    return torch.cat(parts).t().contiguous()


def computed_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every non-empty parameter (by name) and every linear-like module's read-back weight
    (``<module>:computed``): what the model computes with. Tensors are copies."""
    out = {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}
    for name, module, width in linear_modules(model):
        out[name + READ_SUFFIX] = read_back(module, width)
    return out


class Checked(NamedTuple):
    """A worker's check of its live model against vLLM's loader and processing of a checkpoint (crosses vLLM's
    msgpack as a plain list: unpack it positionally or rebuild it with ``Checked(*reply)``)."""

    bad: list[str]
    """Keys computed with other bits (or present on one side only); empty when bit-exact."""
    compared: int
    """Keys compared."""


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys of two :func:`computed_state` results that differ in bits, or are present in only one."""
    bad = [n for n, t in got.items() if n not in want or not bits_equal(t, want[n])]
    return bad + [n for n in want if n not in got]
