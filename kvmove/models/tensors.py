"""The HF checkpoint's tensors (name, shape, dtype) for each supported architecture."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from kvmove.models.config import ModelConfig

_LAYER_RE = re.compile(r"^(model|decoder)\.layers\.(\d+)\.")
"""Decoder layers in HF (``model.layers.N.``) and megatron-core (``decoder.layers.N.``) names."""
_EXPERT_RE = re.compile(r"\.mlp\.experts\.(?:local_experts\.)?(\d+)\.|\.mlp\.experts\.linear_fc[12]\.weight(\d+)$")
"""Routed experts: HF ``mlp.experts.E.``, megatron-core ``mlp.experts.local_experts.E.`` or grouped ``weightE``."""


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


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(2)) if m else None


def expert_of(name: str) -> int | None:
    m = _EXPERT_RE.search(name)
    return int(m.group(1) or m.group(2)) if m else None


def with_layer(name: str, layer: int) -> str:
    """``model.layers.3.x`` -> ``model.layers.{layer}.x``; names outside layers are returned unchanged."""
    return _LAYER_RE.sub(lambda m: f"{m.group(1)}.layers.{layer}.", name, count=1)


def hf_tensors(cfg: ModelConfig, layers: Iterable[int] | None = None) -> list[TensorMeta]:
    """All tensors of the checkpoint in file order, or only those of ``layers`` plus the non-layer ones."""
    wanted = range(cfg.num_hidden_layers) if layers is None else sorted(set(layers))
    out = [TensorMeta("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))]
    for i in wanted:
        out.extend(layer_tensors(cfg, i))
    out.append(TensorMeta("model.norm.weight", (cfg.hidden_size,)))
    if not cfg.tie_word_embeddings:
        out.append(TensorMeta("lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    return out


def layer_tensors(cfg: ModelConfig, i: int) -> list[TensorMeta]:
    p = f"model.layers.{i}."
    h = cfg.hidden_size
    out = list(_mla_attention(cfg, p) if cfg.is_mla else _gqa_attention(cfg, p))
    out.append(TensorMeta(p + "input_layernorm.weight", (h,)))
    out.append(TensorMeta(p + "post_attention_layernorm.weight", (h,)))
    if cfg.is_moe_layer(i):
        out.extend(_moe_mlp(cfg, p))
    else:
        out.extend(_mlp(p + "mlp.", cfg.intermediate_size, h))
    return out


def _gqa_attention(cfg: ModelConfig, p: str) -> Iterator[TensorMeta]:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        yield TensorMeta(f"{p}self_attn.{proj}.weight", (rows, h))
        if cfg.attention_bias:
            yield TensorMeta(f"{p}self_attn.{proj}.bias", (rows,))
    yield TensorMeta(f"{p}self_attn.o_proj.weight", (h, q))
    if cfg.qk_norm:
        yield TensorMeta(f"{p}self_attn.q_norm.weight", (d,))
        yield TensorMeta(f"{p}self_attn.k_norm.weight", (d,))


def _mla_attention(cfg: ModelConfig, p: str) -> Iterator[TensorMeta]:
    h, n = cfg.hidden_size, cfg.num_attention_heads
    a = p + "self_attn."
    if cfg.q_lora_rank:
        yield TensorMeta(a + "q_a_proj.weight", (cfg.q_lora_rank, h))
        yield TensorMeta(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        yield TensorMeta(a + "q_b_proj.weight", (n * cfg.qk_head_dim, cfg.q_lora_rank))
    else:
        yield TensorMeta(a + "q_proj.weight", (n * cfg.qk_head_dim, h))
    yield TensorMeta(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h))
    yield TensorMeta(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,))
    yield TensorMeta(a + "kv_b_proj.weight", (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
    yield TensorMeta(a + "o_proj.weight", (h, n * cfg.v_head_dim))


def _mlp(prefix: str, inter: int, h: int) -> list[TensorMeta]:
    return [
        TensorMeta(prefix + "gate_proj.weight", (inter, h)),
        TensorMeta(prefix + "up_proj.weight", (inter, h)),
        TensorMeta(prefix + "down_proj.weight", (h, inter)),
    ]


def _moe_mlp(cfg: ModelConfig, p: str) -> Iterator[TensorMeta]:
    h = cfg.hidden_size
    yield TensorMeta(p + "mlp.gate.weight", (cfg.num_experts, h))
    if cfg.is_mla:
        yield TensorMeta(p + "mlp.gate.e_score_correction_bias", (cfg.num_experts,))
    for e in range(cfg.num_experts):
        yield from _mlp(f"{p}mlp.experts.{e}.", cfg.moe_intermediate_size, h)
    if cfg.n_shared_experts:
        yield from _mlp(p + "mlp.shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts, h)


class ModelTotals(NamedTuple):
    """What ``kvmove models show`` reports."""

    name: str
    architecture: str
    num_tensors: int
    total_params: int
    total_bytes: int
    expert_params: int
    non_expert_params: int
    num_layers: int
    moe_layers: int


def model_totals(cfg: ModelConfig) -> ModelTotals:
    """Exact totals, computed from one tensor table per layer kind (no full enumeration needed)."""
    count = params = nbytes = expert = 0
    kinds: dict[str, tuple[int, int, int, int]] = {}
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_kind(i)
        if kind not in kinds:
            ts = layer_tensors(cfg, i)
            kinds[kind] = (
                len(ts),
                sum(t.numel for t in ts),
                sum(t.nbytes for t in ts),
                sum(t.numel for t in ts if t.expert is not None),
            )
        c, p, b, e = kinds[kind]
        count, params, nbytes, expert = count + c, params + p, nbytes + b, expert + e
    for t in hf_tensors(cfg, layers=()):
        count, params, nbytes = count + 1, params + t.numel, nbytes + t.nbytes
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return ModelTotals(
        cfg.name,
        cfg.architecture,
        count,
        params,
        nbytes,
        expert,
        params - expert,
        cfg.num_hidden_layers,
        moe_layers,
    )
