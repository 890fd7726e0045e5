"""Forward pass of the reference model (Qwen2/Qwen3 dense and MoE, tp ranks in one process) with attention over a
paged KV pool, on any device.

A ``ForwardBatch`` is the flattened new tokens of several sequences: each sequence computes its tokens
``[start, start + num_new)`` of a context of ``len(context_slots)`` tokens whose KV lives in the pool at
``context_slots`` (position p at ``context_slots[p]``). The pass writes the new tokens' K/V into their slots, then
every new token attends causally over its sequence's context. Hidden states are float32 whatever the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvmove.errors import ModelError
from kvmove.kvcache import KVPool
from kvmove.models.config import ModelConfig
from kvmove.reference.model import ReferenceModel


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of a batch: its new tokens are ``input_ids[offset : offset + num_new]``."""

    offset: int
    num_new: int
    context_slots: torch.Tensor  # [context_len] int64 pool slots of positions 0 .. context_len - 1

    @property
    def context_len(self) -> int:
        return self.context_slots.numel()


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: where each new token's K/V goes
    seqs: tuple[SeqSpan, ...]

    @property
    def last_token_index(self) -> torch.Tensor:
        """Index into the flattened tokens of each sequence's last new token (whose logits sample the next)."""
        return torch.tensor([s.offset + s.num_new - 1 for s in self.seqs], dtype=torch.int64)

    def to(self, device: torch.device) -> ForwardBatch:
        """The batch with every tensor on ``device`` (itself if they are there already)."""
        if self.input_ids.device == device:
            return self
        seqs = tuple(replace(s, context_slots=s.context_slots.to(device)) for s in self.seqs)
        return ForwardBatch(self.input_ids.to(device), self.positions.to(device), self.out_slots.to(device), seqs)


FORWARD_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""The families whose math this module implements (GQA, neox rotary, SiLU MLPs, softmax top-k routing)."""


def check_supported(models: ReferenceModel | Sequence[ReferenceModel]) -> None:
    """Raise ModelError unless this module can run ``models``: GQA attention, ep = pp = 1, every layer, and (for
    tensor parallelism) exactly the ranks ``0 .. tp_size - 1`` of one tp group, in order."""
    ranks = [models] if isinstance(models, ReferenceModel) else list(models)
    cfg = ranks[0].config
    if cfg.architecture not in FORWARD_ARCHITECTURES:
        raise ModelError(
            f"{cfg.name}: the reference forward pass runs {', '.join(FORWARD_ARCHITECTURES)}, not "
            f"{cfg.architecture} (weight sync and --verify load any architecture: they need only the loader)"
        )
    for r, model in enumerate(ranks):
        ctx = model.ctx
        if ctx.ep_size != 1 or ctx.pp_size != 1:
            raise ModelError(f"{cfg.name}: the reference forward pass runs ep = pp = 1 only")
        if ctx.tp_size != len(ranks) or ctx.tp_rank != r:
            raise ModelError(f"{cfg.name}: rank {r} of {len(ranks)} has tp rank {ctx.tp_rank} of {ctx.tp_size}")
        if list(ctx.layers) != list(range(cfg.num_hidden_layers)):
            raise ModelError(f"{cfg.name}: the reference forward pass needs every layer on the rank")
        if ctx.weight_block is not None:
            raise ModelError(f"{cfg.name}: the reference forward pass runs unquantized weights, not block FP8")


def forward(model: ReferenceModel, pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
    """Logits ``[num_seqs, vocab]`` (float32) at each sequence's last new token; writes the new K/V into ``pool``."""
    return forward_ranks([model], [pool], batch)


def forward_ranks(models: Sequence[ReferenceModel], pools: Sequence[KVPool], batch: ForwardBatch) -> torch.Tensor:
    """``forward`` over the tensor-parallel ranks of one worker: rank ``r`` runs its heads and its slice of every
    MLP with its own parameters and KV pool; partial sums are added (the all-reduce) and the vocabulary slices of
    the head concatenated (the all-gather). One rank: the plain tp = 1 pass."""
    device = pools[0].device
    batch = batch.to(device)
    cfg = models[0].config
    x = _all_reduce([m.model.embed_tokens(batch.input_ids).float() for m in models])
    cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta)
    layers: list[list[Any]] = [list(m.model.layers.values()) for m in models]
    for i in range(cfg.num_hidden_layers):
        h = layers[0][i].input_layernorm(x)
        x = x + _all_reduce(
            [attention(ls[i].self_attn, i, h, cos, sin, p, batch) for ls, p in zip(layers, pools, strict=True)]
        )
        h = layers[0][i].post_attention_layernorm(x)
        x = x + _all_reduce([mlp(cfg, ls[i], h) for ls in layers])
    x = models[0].model.norm(x)[batch.last_token_index.to(device)]
    return torch.cat([m.lm_head(x.to(m.lm_head.weight.dtype)).float() for m in models], dim=-1)


def _all_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def mlp(cfg: ModelConfig, layer: Any, h: torch.Tensor) -> torch.Tensor:
    """The layer's MLP (dense or MoE) on the normalized hidden states: this rank's partial sum."""
    block = layer.mlp
    if "experts" in block:
        return moe(block, h, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return dense_mlp(block, h)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary tables ``[T, 1, head_dim]`` (float32) for ``positions``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float().unsqueeze(1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(
    attn: Any,
    index: int,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: KVPool,
    batch: ForwardBatch,
) -> torch.Tensor:
    """Write the new tokens' K/V into their slots, then attend over each sequence's context in the pool.

    Attention runs per sequence with ``scaled_dot_product_attention`` (flash or memory-efficient kernels on
    cuda, GQA without repeating K/V) in the pool's dtype, causal with the queries at the end of the context.
    """
    proj = attn.qkv_proj
    d = proj.head_dim
    q, k, v = proj(x.to(proj.weight.dtype)).float().split(list(proj.sizes), dim=-1)
    q, k, v = q.view(-1, proj.q_heads, d), k.view(-1, proj.kv_heads, d), v.view(-1, proj.kv_heads, d)
    if "q_norm" in attn:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dtype = pool.geometry.dtype
    pool.write(index, batch.out_slots, k.to(dtype), v.to(dtype))
    q = q.to(dtype)
    out = torch.empty_like(q)
    k_buf, v_buf = pool.k_buffer(index), pool.v_buffer(index)
    for s in batch.seqs:
        queries = q[s.offset : s.offset + s.num_new].transpose(0, 1).unsqueeze(0)  # [1, H, Q, d]
        keys = k_buf[s.context_slots].transpose(0, 1).unsqueeze(0)  # [1, H_kv, L, d]
        values = v_buf[s.context_slots].transpose(0, 1).unsqueeze(0)
        mask = _causal_mask(s.num_new, s.context_len, q.device)
        attended = _sdpa(queries, keys, values, mask, mask is None and s.num_new > 1)
        out[s.offset : s.offset + s.num_new] = attended[0].transpose(0, 1)
    return attn.o_proj(out.reshape(out.shape[0], -1).to(attn.o_proj.weight.dtype)).float()


FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
"""On cuda attention never falls back to the math kernel, which materializes every score (32k tokens: 275 GB)."""


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """GQA attention: K/V heads shared by their query groups natively, or repeated where no fast kernel takes them."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    with sdpa_kernel(FAST_SDPA):
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        except RuntimeError:  # NOTE: e.g. a mask (a prefix-cached extend): flash takes none, efficient no GQA
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _causal_mask(num_new: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[Q, L]`` mask letting query ``i`` (position ``L - Q + i``) see keys ``0 .. L - Q + i``; None where
    SDPA's own flags say it (one query sees everything; ``Q == L`` is plain causal)."""
    if num_new == 1 or num_new == context_len:
        return None
    q_pos = torch.arange(context_len - num_new, context_len, device=device).unsqueeze(1)
    return torch.arange(context_len, device=device).unsqueeze(0) <= q_pos


def dense_mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_up_proj(x.to(mlp.gate_up_proj.weight.dtype)).float().chunk(2, dim=-1)
    return mlp.down_proj((F.silu(gate) * up).to(mlp.down_proj.weight.dtype)).float()


def moe(mlp: Any, x: torch.Tensor, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """Softmax router, top-k experts (renormalized if ``norm_topk_prob``), each expert run on its tokens."""
    experts = mlp.experts
    probs = mlp.gate(x.to(mlp.gate.weight.dtype)).float().softmax(dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    w13, w2 = experts.w13_weight, experts.w2_weight
    for e in torch.unique(chosen).tolist():
        token, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[token].to(w13.dtype), w13[e]).float().chunk(2, dim=-1)
        y = F.linear((F.silu(gate) * up).to(w2.dtype), w2[e]).float()
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(1))
    return out
