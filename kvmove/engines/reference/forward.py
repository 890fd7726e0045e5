"""Forward pass of the reference model (Qwen2/Qwen3 dense and MoE, tp=1) with attention over a paged KV pool.

A ``ForwardBatch`` is the flattened new tokens of several sequences: each sequence computes its tokens
``[start, start + num_new)`` of a context of ``len(context_slots)`` tokens whose KV lives in the pool at
``context_slots`` (position p at ``context_slots[p]``). The pass writes the new tokens' K/V into their slots, then
every new token attends causally over its sequence's context. Hidden states are float32 whatever the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmove.engines.reference.model import DecoderLayer, DenseMLP, GQAAttention, MoEMLP, ReferenceModel
from kvmove.errors import ModelError
from kvmove.kvcache import KVPool
from kvmove.models.config import ModelConfig


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


@dataclass(frozen=True)
class PaddedAttention:
    """The batch's sequences padded to ``[B, max new]`` queries over ``[B, max context]`` keys, built once a pass."""

    query_index: torch.Tensor  # [B, Q] flattened token of each query (padding: 0)
    query_valid: torch.Tensor  # [B, Q] bool
    context_slots: torch.Tensor  # [B, L] pool slots (padding: the sequence's first slot)
    allowed: torch.Tensor  # [B, 1, 1, Q, L] bool: causal within the context, padding masked

    @classmethod
    def of(cls, batch: ForwardBatch) -> PaddedAttention:
        seqs = batch.seqs
        q_max, l_max = max(s.num_new for s in seqs), max(s.context_len for s in seqs)
        qi = torch.arange(q_max)
        offsets = torch.tensor([s.offset for s in seqs]).unsqueeze(1)
        num_new = torch.tensor([s.num_new for s in seqs]).unsqueeze(1)
        ctx_len = torch.tensor([s.context_len for s in seqs]).unsqueeze(1)
        valid = qi < num_new
        slots = torch.stack(
            [F.pad(s.context_slots, (0, l_max - s.context_len), value=int(s.context_slots[0])) for s in seqs]
        )
        q_pos = (ctx_len - num_new + qi).unsqueeze(2)  # [B, Q, 1]
        keys = torch.arange(l_max).view(1, 1, -1)
        # NOTE: padded queries may see key 0 only, so that no softmax row is all -inf (their output is dropped)
        allowed = ((keys <= q_pos) & (keys < ctx_len.unsqueeze(2)) & valid.unsqueeze(2)) | (
            (keys == 0) & ~valid.unsqueeze(2)
        )
        return cls(torch.where(valid, offsets + qi, 0), valid, slots, allowed[:, None, None])


def check_supported(model: ReferenceModel) -> None:
    """Raise ModelError unless this module can run ``model`` (GQA attention, tp=1, one stage)."""
    cfg, ctx = model.config, model.ctx
    if cfg.is_mla:
        raise ModelError(f"{cfg.name}: the reference forward pass supports GQA models only, not MLA")
    if ctx.tp_size != 1 or ctx.ep_size != 1 or ctx.pp_size != 1:
        raise ModelError(f"{cfg.name}: the reference forward pass runs tp=ep=pp=1 only")
    if list(ctx.layers) != list(range(cfg.num_hidden_layers)):
        raise ModelError(f"{cfg.name}: the reference forward pass needs every layer on the rank")
    if ctx.weight_block is not None:
        raise ModelError(f"{cfg.name}: the reference forward pass runs unquantized weights, not block FP8")


def forward(model: ReferenceModel, pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
    """Logits ``[num_seqs, vocab]`` (float32) at each sequence's last new token; writes the new K/V into ``pool``."""
    x = model.model.embed_tokens(batch.input_ids).float()
    cos, sin = rope_cos_sin(batch.positions, model.config.head_dim, model.config.rope_theta)
    padded = PaddedAttention.of(batch)
    layers: list[DecoderLayer] = list(model.model.layers.values())  # type: ignore[arg-type]
    for i, layer in enumerate(layers):
        x = decoder_layer(model.config, layer, i, x, cos, sin, pool, batch, padded)
    x = model.model.norm(x)
    return model.lm_head(x[batch.last_token_index]).float()


def decoder_layer(
    cfg: ModelConfig,
    layer: DecoderLayer,
    index: int,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: KVPool,
    batch: ForwardBatch,
    padded: PaddedAttention,
) -> torch.Tensor:
    attn = layer.self_attn
    assert isinstance(attn, GQAAttention)
    x = x + attention(attn, index, layer.input_layernorm(x), cos, sin, pool, batch, padded)
    h = layer.post_attention_layernorm(x)
    mlp = layer.mlp
    if isinstance(mlp, MoEMLP):
        return x + moe(mlp, h, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    assert isinstance(mlp, DenseMLP)
    return x + dense_mlp(mlp, h)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary tables ``[T, 1, head_dim]`` (float32) for ``positions``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(
    attn: GQAAttention,
    index: int,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: KVPool,
    batch: ForwardBatch,
    padded: PaddedAttention,
) -> torch.Tensor:
    """Write the new tokens' K/V into their slots, then attend over each sequence's context in the pool."""
    proj = attn.qkv_proj
    d = proj.head_dim
    q, k, v = proj(x.to(proj.weight.dtype)).float().split(list(proj.sizes), dim=-1)
    q, k, v = q.view(-1, proj.q_heads, d), k.view(-1, proj.kv_heads, d), v.view(-1, proj.kv_heads, d)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dtype = pool.geometry.dtype
    pool.write(index, batch.out_slots, k.to(dtype), v.to(dtype))
    group = proj.q_heads // proj.kv_heads
    keys = pool.k_buffer(index)[padded.context_slots].float()  # [B, L, H_kv, d]
    values = pool.v_buffer(index)[padded.context_slots].float()
    queries = q[padded.query_index].unflatten(2, (proj.kv_heads, group))  # [B, Q, H_kv, G, d]: GQA groups
    scores = torch.einsum("bqkgd,blkd->bkgql", queries, keys) * d**-0.5
    probs = scores.masked_fill(~padded.allowed, float("-inf")).softmax(dim=-1)
    attended = torch.einsum("bkgql,blkd->bqkgd", probs, values).flatten(2, 3)  # [B, Q, H, d]
    out = torch.empty_like(q)
    out[padded.query_index[padded.query_valid]] = attended[padded.query_valid]
    return attn.o_proj(out.reshape(out.shape[0], -1).to(attn.o_proj.weight.dtype)).float()


def dense_mlp(mlp: DenseMLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_up_proj(x.to(mlp.gate_up_proj.weight.dtype)).float().chunk(2, dim=-1)
    return mlp.down_proj((F.silu(gate) * up).to(mlp.down_proj.weight.dtype)).float()


def moe(mlp: MoEMLP, x: torch.Tensor, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
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
