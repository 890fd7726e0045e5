"""Megatron's role of every HF checkpoint tensor, declared per architecture family (data, not branches).

A Megatron-style trainer (megatron-core through Megatron-Bridge) splits each tensor by its role:
column-parallel (output rows over TP), row-parallel (input columns over TP), vocab-parallel (embedding and output
rows over TP), replicated, and routed experts (whole experts over EP, each split column- or row-wise over ETP).
Each family lists the architectures it covers and, for the module that holds a tensor (``...<module>.<param>``),
the role by glob pattern; the first matching rule wins. A tensor of a family's model that no rule classifies is
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
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    REPLICATED = "replicated"

    @property
    def dim(self) -> int | None:
        """The split dim of a 2-D weight with this role (a bias of a column-parallel module splits on 0 too)."""
        return {"column": 0, "vocab": 0, "row": 1}.get(self.value)


class Family(NamedTuple):
    """Architectures whose checkpoints Megatron shards alike, and the role of each module (glob, role)."""

    name: str
    architectures: tuple[str, ...]
    rules: tuple[tuple[str, Role], ...]


_NORMS = (("*norm", Role.REPLICATED),)
_VOCAB = (("embed_tokens", Role.VOCAB), ("lm_head", Role.VOCAB))
_GQA = (
    ("q_proj", Role.COLUMN),
    ("k_proj", Role.COLUMN),
    ("v_proj", Role.COLUMN),
    ("o_proj", Role.ROW),
)
_MLP = (
    ("gate_proj", Role.COLUMN),
    ("up_proj", Role.COLUMN),
    ("down_proj", Role.ROW),
)
_EXPERTS = (  # per-expert projections (HF and Mixtral spellings); the router and its bias are replicated
    ("w1", Role.COLUMN),
    ("w3", Role.COLUMN),
    ("w2", Role.ROW),
    ("gate", Role.REPLICATED),
)
_MLA = (
    ("q_a_proj", Role.REPLICATED),
    ("kv_a_proj_with_mqa", Role.REPLICATED),
    ("q_b_proj", Role.COLUMN),
    ("kv_b_proj", Role.COLUMN),
    ("q_proj", Role.COLUMN),
    ("o_proj", Role.ROW),
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
    family = next((f for f in FAMILIES if cfg.architecture in f.architectures), None)
    if family is None:
        raise PlanError(
            f"no Megatron sharding rule for tensor {name}: {cfg.architecture} is in no family of kvmove.models.roles "
            f"(known: {', '.join(a for f in FAMILIES for a in f.architectures)})"
        )
    role = _role(family, name.rsplit(".", 2)[-2] if "." in name else name)
    if role is None:
        raise PlanError(f"no Megatron sharding rule of family {family.name} classifies tensor {name}")
    return role


@lru_cache(maxsize=4096)
def _role(family: Family, module: str) -> Role | None:
    return next((role for pattern, role in family.rules if fnmatchcase(module, pattern)), None)
