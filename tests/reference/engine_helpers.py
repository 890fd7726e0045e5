"""Helpers of the rollout-worker tests: seeded tiny checkpoints, prompts, and a plain dense (non-paged, HF-named,
full recomputation each step) reference implementation of the Qwen family."""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from kvmove.models import resolve_model
from kvmove.models.config import ModelConfig
from kvmove.models.table import is_moe_layer
from kvmove.models.weights import seeded_checkpoint


@cache
def weights(model: str, seed: int = 1) -> dict[str, torch.Tensor]:
    return seeded_checkpoint(resolve_model(model), seed)


def prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- dense reference -------------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` with ``rotate_half``; x is [T, H, d] at positions 0..T-1."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    ang = torch.outer(torch.arange(t).double(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _linear(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


def dense_logits(cfg: ModelConfig, hf: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` of a full causal pass, straight from the HF checkpoint (float32)."""
    w = {k: v.float() for k, v in hf.items()}
    eps, d, heads, kv_heads = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    t = len(ids)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        h = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
        q = _linear(w, f"{p}.self_attn.q_proj", h).view(t, heads, d)
        k = _linear(w, f"{p}.self_attn.k_proj", h).view(t, kv_heads, d)
        v = _linear(w, f"{p}.self_attn.v_proj", h).view(t, kv_heads, d)
        if cfg.qk_norm:
            q, k = _rms(q, w[f"{p}.self_attn.q_norm.weight"], eps), _rms(k, w[f"{p}.self_attn.k_norm.weight"], eps)
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        rep = heads // kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", attn, v).reshape(t, heads * d)
        x = x + _linear(w, f"{p}.self_attn.o_proj", o)
        h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        x = x + (_moe(cfg, w, p, h) if is_moe_layer(cfg, i) else _mlp(w, f"{p}.mlp", h))
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def _mlp(w: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    return _linear(w, f"{p}.down_proj", F.silu(_linear(w, f"{p}.gate_proj", h)) * _linear(w, f"{p}.up_proj", h))


def _moe(cfg: ModelConfig, w: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    probs = _linear(w, f"{p}.mlp.gate", h).softmax(-1)
    top, idx = probs.topk(cfg.num_experts_per_tok, -1)
    if cfg.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for tok in range(h.shape[0]):
        for weight, e in zip(top[tok].tolist(), idx[tok].tolist(), strict=True):
            out[tok] += weight * _mlp(w, f"{p}.mlp.experts.{e}", h[tok : tok + 1])[0]
    return out


def dense_greedy(cfg: ModelConfig, hf: dict[str, torch.Tensor], ids: list[int], n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence every step."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(dense_logits(cfg, hf, seq)[-1].argmax()))
    return seq[len(ids) :]
