"""One HF checkpoint tensor (name, shape, dtype), the metadata every planner reads, and what its name says; and a
checkpoint's tensors as a table (:class:`TensorTable`: one template per kind of decoder layer)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from kvmove.errors import ModelError

_LAYER_RE = re.compile(r"^(model|decoder)\.layers\.(\d+)\.")
"""Decoder layers in HF (``model.layers.N.``) and megatron-core (``decoder.layers.N.``) names."""
_EXPERT_RE = re.compile(r"\.experts\.(?:local_experts\.)?(\d+)\.|\.mlp\.experts\.linear_fc[12]\.weight(\d+)$")
"""Routed experts: HF ``mlp.experts.E.`` (Mixtral: ``block_sparse_moe.experts.E.``), megatron-core
``mlp.experts.local_experts.E.`` or grouped ``weightE``."""
_FUSED_EXPERTS_RE = re.compile(r"\.experts\.[a-z_]+$")
"""Every routed expert of a layer in one tensor: ``feed_forward.experts.gate_up_proj`` (kvmove.models.experts)."""


class TensorMeta(NamedTuple):
    """One HF tensor as a BF16 trainer holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def layer(self) -> int | None:
        return layer_of(self.name)

    @property
    def expert(self) -> int | None:
        return expert_of(self.name)

    @property
    def routed(self) -> bool:
        """Whether the tensor holds routed experts' weights (one expert's, or every expert's of a layer)."""
        return self.expert is not None or _FUSED_EXPERTS_RE.search(self.name) is not None


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(2)) if m else None


def expert_of(name: str) -> int | None:
    m = _EXPERT_RE.search(name)
    return int(m.group(1) or m.group(2)) if m else None


def with_layer(name: str, layer: int) -> str:
    """``model.layers.3.x`` -> ``model.layers.{layer}.x``; names outside layers are returned unchanged."""
    return _LAYER_RE.sub(lambda m: f"{m.group(1)}.layers.{layer}.", name, count=1)


class TensorTable(NamedTuple):
    """Every tensor of one checkpoint: those before the decoder layers, one template per layer kind, those after."""

    head: tuple[TensorMeta, ...]
    """Tensors outside the decoder layers that precede them (``model.embed_tokens.weight``)."""
    kinds: tuple[str, ...]
    """The kind of each decoder layer."""
    templates: Mapping[str, tuple[int, tuple[TensorMeta, ...]]]
    """kind -> (its first layer, that layer's tensors)."""
    tail: tuple[TensorMeta, ...]
    """Tensors outside the decoder layers that follow them (final norm, ``lm_head.weight``)."""

    def layer(self, i: int) -> list[TensorMeta]:
        """The tensors of decoder layer ``i``, in checkpoint order."""
        if not 0 <= i < len(self.kinds):
            raise ModelError(f"layer {i} is outside the model's {len(self.kinds)} layers")
        first, tensors = self.templates[self.kinds[i]]
        if first == i:
            return list(tensors)
        return [t._replace(name=with_layer(t.name, i)) for t in tensors]

    def tensors(self, layers: Iterable[int] | None = None) -> list[TensorMeta]:
        wanted = range(len(self.kinds)) if layers is None else sorted(set(layers))
        out = list(self.head)
        for i in wanted:
            out += self.layer(i)
        return out + list(self.tail)
