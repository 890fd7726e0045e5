"""Megatron's role of every HF checkpoint tensor, declared per architecture family (data, not branches).

A Megatron-style trainer (megatron-core through Megatron-Bridge) splits each tensor by its role:
column-parallel (output rows over TP), row-parallel (input columns over TP), vocab-parallel (embedding and output
rows over TP), replicated, and routed experts (whole experts over EP, each split column- or row-wise over ETP;
where a checkpoint holds every expert of a layer in one tensor, its dim 0 is split over EP). Each family lists the
architectures it covers and, for the last two components of a tensor's name (``...<module>.<param>``), the role
by glob pattern; the first matching rule wins. A tensor of a family's model that no rule classifies is
refused by name: planning never guesses a split. Sources: docs/models.md.
"""

from __future__ import annotations

from enum import Enum
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import NamedTuple

from kvmove.errors import PlanError
from kvmove.models.config import ModelConfig


class Role(Enum):
    """A tensor's split: ``dim`` over TP (over ETP for a routed expert's tensor; None: whole on every rank) and,
    for ``fused`` experts (every expert of a layer in one tensor, dim 0), whole experts over EP."""

    COLUMN = ("column", 0, False)
    """``[out, in]`` weight or ``[out]`` bias (or one entry per head): output rows over TP."""
    ROW = ("row", 1, False)
    """``[out, in]`` weight: input columns over TP (its bias is REPLICATED: added once, after the reduction)."""
    VOCAB = ("vocab", 0, False)
    REPLICATED = ("replicated", None, False)
    EXPERTS_COLUMN = ("experts-column", 2, True)
    """Fused ``[E, in, out]``: output columns over ETP (kvmove.models.experts: where gate and up lie)."""
    EXPERTS_COLUMN_BIAS = ("experts-column-bias", 1, True)
    """Fused ``[E, out]`` bias of a column-parallel projection: over ETP with its columns."""
    EXPERTS_ROW = ("experts-row", 1, True)
    """Fused ``[E, in, out]``: input rows over ETP."""
    EXPERTS = ("experts", None, True)
    """Fused ``[E, out]`` bias of a row-parallel projection: whole experts over EP, whole on every ETP rank."""

    label: str
    dim: int | None
    fused: bool

    def __init__(self, label: str, dim: int | None, fused: bool) -> None:
        self.label, self.dim, self.fused = label, dim, fused


class Family(NamedTuple):
    """Architectures whose checkpoints Megatron shards alike, and the role of each tensor by glob over its last
    two name components, ``<module>.<param>`` (``q_proj.weight``, ``experts.gate_up_proj``)."""

    name: str
    architectures: tuple[str, ...]
    rules: tuple[tuple[str, Role], ...]


_NORMS = (("*norm.*", Role.REPLICATED),)
_VOCAB = (("embed_tokens.*", Role.VOCAB), ("lm_head.*", Role.VOCAB))
_GQA = (
    ("q_proj.*", Role.COLUMN),
    ("k_proj.*", Role.COLUMN),
    ("v_proj.*", Role.COLUMN),
    ("o_proj.bias", Role.REPLICATED),
    ("o_proj.*", Role.ROW),
)
_MLP = (  # dense MLPs and shared experts (over TP)
    ("gate_proj.*", Role.COLUMN),
    ("up_proj.*", Role.COLUMN),
    ("down_proj.bias", Role.REPLICATED),
    ("down_proj.*", Role.ROW),
)
_EXPERTS = (  # per-expert projections (HF and Mixtral spellings); the router and its bias are replicated
    ("w1.*", Role.COLUMN),
    ("w3.*", Role.COLUMN),
    ("w2.*", Role.ROW),
    ("gate.*", Role.REPLICATED),
)
_FUSED_EXPERTS = (  # every expert of a layer in one tensor per projection (gpt-oss, Llama 4); the router replicated
    ("experts.gate_up_proj", Role.EXPERTS_COLUMN),
    ("experts.gate_up_proj_bias", Role.EXPERTS_COLUMN_BIAS),
    ("experts.down_proj", Role.EXPERTS_ROW),
    ("experts.down_proj_bias", Role.EXPERTS),
    ("router.*", Role.REPLICATED),
)
_SINKS = (("self_attn.sinks", Role.COLUMN),)  # attention sinks: one per head, split over TP with the heads
_MLA = (
    ("q_a_proj.*", Role.REPLICATED),
    ("kv_a_proj_with_mqa.*", Role.REPLICATED),
    ("q_b_proj.*", Role.COLUMN),
    ("kv_b_proj.*", Role.COLUMN),
    ("q_proj.*", Role.COLUMN),
    ("o_proj.*", Role.ROW),
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "gqa-dense",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM"),
        (*_VOCAB, *_NORMS, *_GQA, *_MLP),
    ),
    Family(
        "gqa-moe",
        ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"),
        (*_VOCAB, *_NORMS, *_GQA, *_MLP, *_EXPERTS),
    ),
    Family("mla-moe", ("DeepseekV3ForCausalLM",), (*_VOCAB, *_NORMS, *_MLA, *_MLP, *_EXPERTS)),
    Family(
        "gqa-fused-moe",
        ("GptOssForCausalLM", "Llama4ForCausalLM"),
        (*_VOCAB, *_NORMS, *_SINKS, *_GQA, *_MLP, *_FUSED_EXPERTS),
    ),
)
"""Megatron-Bridge maps each of these architectures onto megatron-core's GPT model with these splits."""


def families_of(cfg: ModelConfig) -> tuple[str, ...]:
    """The names of the families whose Megatron rules apply to ``cfg`` (empty: a Megatron source cannot be
    planned by rule; FSDP2/DTensor sources declare their own shards)."""
    return tuple(f.name for f in FAMILIES if cfg.architecture in f.architectures)


def check_classified(cfg: ModelConfig) -> None:
    """Every tensor of ``cfg``'s checkpoint has a Megatron role (one layer of each kind stands for the rest);
    PlanError naming the first that has none."""
    from kvmove.models.table import table_of

    table = table_of(cfg)
    for t in [*table.head, *(t for _, ts in table.templates.values() for t in ts), *table.tail]:
        role_of(cfg, t.name)


def role_of(cfg: ModelConfig, name: str) -> Role:
    """Megatron's role of HF tensor ``name`` of ``cfg`` (PlanError naming the tensor if no rule classifies it)."""
    family = _family(cfg.architecture)
    if family is None:
        raise PlanError(
            f"no Megatron sharding rule for tensor {name}: {cfg.architecture} is in no family of kvmove.models.roles "
            f"(known: {', '.join(a for f in FAMILIES for a in f.architectures)})"
        )
    role = _role(cfg.architecture, ".".join(name.rsplit(".", 2)[-2:]))
    if role is None:
        raise PlanError(f"no Megatron sharding rule of family {family.name} classifies tensor {name}")
    return role


@lru_cache(maxsize=64)
def _family(architecture: str) -> Family | None:
    return next((f for f in FAMILIES if architecture in f.architectures), None)


@lru_cache(maxsize=4096)
def _role(architecture: str, tail: str) -> Role | None:
    """The role of the tensor whose name ends in ``tail`` in ``architecture``'s family (memoized by name: a family
    is a table of enums, slow to hash)."""
    family = _family(architecture)
    assert family is not None
    return next((role for pattern, role in family.rules if fnmatchcase(tail, pattern)), None)
