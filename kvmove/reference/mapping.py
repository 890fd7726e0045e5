"""How the reference engine lays out a checkpoint: which HF tensors it fuses into one parameter, which it splits
over tensor-parallel ranks and how, declared as tables the way serving engines declare theirs (vLLM's
``stacked_params_mapping`` and ``expert_params_mapping``).

The model builder (kvmove.reference.model) reads these tables against the checkpoint's tensor table to
choose each module's layer class; the loader (kvmove.reference.loader) reads them to route each HF tensor
into its parameter. Nothing here names an architecture: a model whose tensors follow these conventions loads.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Stacked(NamedTuple):
    """HF module ``piece`` lands as shard ``shard`` of the fused module ``fused`` (a sibling of it)."""

    fused: str
    piece: str
    shard: str | int


STACKED_PARAMS: tuple[Stacked, ...] = (
    Stacked("qkv_proj", "q_proj", "q"),
    Stacked("qkv_proj", "k_proj", "k"),
    Stacked("qkv_proj", "v_proj", "v"),
    Stacked("gate_up_proj", "gate_proj", 0),
    Stacked("gate_up_proj", "up_proj", 1),
    Stacked("fused_qkv_a_proj", "q_a_proj", 0),
    Stacked("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
)
"""A fused module is built only where every one of its pieces is in the checkpoint (MLA without a q LoRA keeps
``q_proj`` and ``kv_a_proj_with_mqa`` apart)."""

EXPERT_PARAMS: dict[str, str] = {
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
    "w1": "w1",
    "w3": "w3",
    "w2": "w2",
}
"""Per-expert checkpoint projection -> the FusedMoE shard it fills (w1, w3 into ``w13_*``; w2 into ``w2_*``)."""


class FusedExpert(NamedTuple):
    """The FusedMoE parameter a fused expert checkpoint tensor fills, and which of its shards it is."""

    param: str
    shard: str


FUSED_EXPERT_PARAMS: dict[str, FusedExpert] = {
    "gate_up_proj": FusedExpert("w13_weight", "w13"),
    "gate_up_proj_bias": FusedExpert("w13_bias", "w13"),
    "down_proj": FusedExpert("w2_weight", "w2"),
    "down_proj_bias": FusedExpert("w2_bias", "w2"),
}
"""Checkpoint tensors holding every expert of a layer (``[E, in, out]`` weights, ``[E, out]`` biases; gpt-oss,
Llama 4) -> the FusedMoE parameter they fill; kvmove.models.experts says where gate and up lie in ``gate_up_proj``."""

FUSED_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>\w+)$")
"""A fused expert checkpoint tensor: ``<...>.experts.<leaf>`` (no expert index)."""

EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight(_scale_inv)?)$")
"""A per-expert checkpoint tensor: ``<...>.experts.<E>.<proj>.weight`` (and an FP8 checkpoint's block scales)."""

ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
"""Modules whose input dim is split over tp (outputs are partial sums)."""

COLUMN_PARALLEL = frozenset({"q_proj", "q_b_proj", "kv_b_proj"})
"""Modules not fused with siblings whose output dim is split over tp."""

HEAD_PARALLEL = frozenset({"sinks"})
"""1-D per-head parameters (attention sinks): split over tp with the heads."""

VOCAB_PARALLEL = {"model.embed_tokens": "embedding", "lm_head": "head"}
"""The vocabulary-parallel modules: rows of the (padded) vocabulary split over tp."""

TIED = ("model.embed_tokens.weight", "lm_head.weight")
"""Where a checkpoint has no ``lm_head.weight`` (tied embeddings), the embedding also loads the head."""


def stacked_of(module: str) -> Stacked | None:
    """The stacking rule of HF module leaf ``module`` (e.g. ``k_proj``), if any."""
    return next((s for s in STACKED_PARAMS if s.piece == module), None)


def pieces_of(fused: str) -> tuple[Stacked, ...]:
    return tuple(s for s in STACKED_PARAMS if s.fused == fused)


class FusedTarget(NamedTuple):
    """Where a fused expert checkpoint tensor lands: parameter ``<prefix>.<target.param>``."""

    prefix: str
    target: FusedExpert


def fused_expert_of(name: str) -> FusedTarget | None:
    """The FusedMoE parameter fused expert checkpoint tensor ``name`` fills (None: not one)."""
    m = FUSED_EXPERT_NAME.match(name)
    if m is None or m["leaf"] not in FUSED_EXPERT_PARAMS:
        return None
    return FusedTarget(m["prefix"], FUSED_EXPERT_PARAMS[m["leaf"]])
