"""The reference inference model: one engine rank's parameters in vLLM's fused layout."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from kvmove.engines.reference.layers import (
    ColumnParallelLinear,
    FusedMoE,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RankContext,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from kvmove.layout import EngineCoord, EngineLayout
from kvmove.models.checkpoint import engine_format
from kvmove.models.config import ModelConfig


class GQAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: RankContext) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            ctx, h, d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias, "self_attn.qkv_proj"
        )
        self.o_proj = RowParallelLinear(ctx, cfg.num_attention_heads * d, h, label="self_attn.o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(ctx, d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(ctx, d, cfg.rms_norm_eps)


class MLAAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention, as vLLM lays out its parameters."""

    def __init__(self, cfg: ModelConfig, ctx: RankContext) -> None:
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_attention_heads
        kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            q_a = [cfg.q_lora_rank, kv_a]
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                ctx, h, q_a, tp=False, label="self_attn.fused_qkv_a_proj"
            )
            self.q_a_layernorm = RMSNorm(ctx, cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(ctx, cfg.q_lora_rank, n * cfg.qk_head_dim, label="self_attn.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(ctx, h, n * cfg.qk_head_dim, label="self_attn.q_proj")
            self.kv_a_proj_with_mqa = ReplicatedLinear(ctx, h, kv_a)
        self.kv_a_layernorm = RMSNorm(ctx, cfg.kv_lora_rank, cfg.rms_norm_eps)
        kv_b = n * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(ctx, cfg.kv_lora_rank, kv_b, label="self_attn.kv_b_proj")
        self.o_proj = RowParallelLinear(ctx, n * cfg.v_head_dim, h, label="self_attn.o_proj")


class DenseMLP(nn.Module):
    def __init__(self, ctx: RankContext, hidden: int, inter: int, label: str = "mlp") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(ctx, hidden, [inter, inter], label=f"{label}.gate_up_proj")
        self.down_proj = RowParallelLinear(ctx, inter, hidden, label=f"{label}.down_proj")


class MoEMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: RankContext) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.gate = ReplicatedLinear(ctx, h, cfg.num_experts, quantized=False)  # the router stays in ctx.dtype
        if cfg.is_mla:
            bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=ctx.dtype, device=ctx.device), requires_grad=False)
            bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
            self.gate.register_parameter("e_score_correction_bias", bias)
        self.experts = FusedMoE(ctx, cfg.num_experts, h, cfg.moe_intermediate_size)
        if cfg.n_shared_experts:
            shared = cfg.moe_intermediate_size * cfg.n_shared_experts
            self.shared_experts = DenseMLP(ctx, h, shared, "mlp.shared_experts")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: RankContext, index: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg, ctx) if cfg.is_mla else GQAAttention(cfg, ctx)
        self.mlp = (
            MoEMLP(cfg, ctx) if cfg.is_moe_layer(index) else DenseMLP(ctx, cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(ctx, cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(ctx, cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: RankContext) -> None:
        super().__init__()
        if ctx.first_stage:
            self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, ctx, i) for i in ctx.layers})
        if ctx.last_stage:
            self.norm = RMSNorm(ctx, cfg.hidden_size, cfg.rms_norm_eps)


class ReferenceModel(nn.Module):
    """Parameters of one engine rank; ``load_weights`` (kvmove.engines.reference.loader) fills them."""

    def __init__(self, cfg: ModelConfig, ctx: RankContext) -> None:
        super().__init__()
        self.config, self.ctx = cfg, ctx
        self.model = Backbone(cfg, ctx)
        if ctx.last_stage:
            self.lm_head = ParallelLMHead(ctx, cfg.vocab_size, cfg.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from kvmove.engines.reference.loader import load_weights

        return load_weights(self, weights)


def rank_context(
    cfg: ModelConfig,
    layout: EngineLayout,
    coord: EngineCoord,
    *,
    layers: Sequence[int] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> RankContext:
    """The context of engine rank ``coord``; ``layers`` restricts the held layers (dry-run templates)."""
    held = tuple(layout.stage_layers(cfg)[coord.pp])
    if layers is not None:
        held = tuple(i for i in held if i in set(layers))
    return RankContext(
        tp_size=layout.tp,
        tp_rank=coord.tp,
        ep_size=layout.ep,
        ep_rank=coord.ep,
        pp_size=layout.pp,
        pp_rank=coord.pp,
        layers=held,
        dtype=dtype,
        device=device,
        weight_block=engine_format(cfg).weight_block,
    )
