"""Checkpoints that hold each layer's experts fused: how their tensors lie (data, one entry per architecture).

Most MoE checkpoints store one tensor per expert and projection (``mlp.experts.7.gate_proj.weight``). gpt-oss and
Llama 4 store one tensor per layer and projection instead, ``<...>.experts.gate_up_proj`` ``[E, in, 2·I]`` and
``<...>.experts.down_proj`` ``[E, I, out]`` (gpt-oss adds ``gate_up_proj_bias`` ``[E, 2·I]`` and
``down_proj_bias`` ``[E, out]``): input-major, the transpose of ``nn.Linear``'s ``[out, in]``. The one fact that
differs between them is where gate and up lie on ``gate_up_proj``'s last dim, which decides how a split of the
intermediate dim cuts it:

- **interleaved** (gpt-oss: ``GptOssExperts`` takes ``gate_up[..., ::2]`` and ``gate_up[..., 1::2]``): columns
  ``2j`` and ``2j + 1`` are gate and up of intermediate unit ``j``, so the units ``[a, b)`` a rank holds are one
  block of columns ``[2a, 2b)``;
- **halves** (Llama 4: ``Llama4TextExperts`` takes ``gate_up.chunk(2, dim=-1)``): gate is columns ``[0, I)``,
  up ``[I, 2I)``, so the units ``[a, b)`` are two blocks, ``[a, b)`` and ``[I + a, I + b)``.

Sources: transformers' modeling files of both (``models/gpt_oss/modeling_gpt_oss.py``,
``models/llama4/modeling_llama4.py``); docs/models.md.
"""

from __future__ import annotations

from typing import NamedTuple

from kvmove.errors import ModelError
from kvmove.models.config import ModelConfig


class FusedExperts(NamedTuple):
    """How one architecture's fused expert tensors lie (see the module docstring)."""

    interleaved: bool
    """gate and up alternate on ``gate_up_proj``'s last dim (else: gate is its first half, up its second)."""


FUSED_EXPERTS: dict[str, FusedExperts] = {
    "GptOssForCausalLM": FusedExperts(interleaved=True),
    "Llama4ForCausalLM": FusedExperts(interleaved=False),
}


def fused_experts(cfg: ModelConfig) -> FusedExperts:
    """How ``cfg``'s checkpoint lays out its fused experts (ModelError for an architecture not in the table)."""
    found = FUSED_EXPERTS.get(cfg.architecture)
    if found is None:
        raise ModelError(
            f"{cfg.architecture} holds fused expert tensors, and kvmove does not know whether their gate and up "
            f"columns interleave (known: {', '.join(FUSED_EXPERTS)}; kvmove.models.experts)"
        )
    return found
