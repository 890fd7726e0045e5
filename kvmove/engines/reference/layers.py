"""Parallel layers of the reference engine, with vLLM's fused parameter layouts and weight loaders.

Each parameter carries a ``weight_loader(param, loaded_weight, ...)`` written the way engine loaders are:
``narrow``/``chunk``/index into the loaded HF tensor, then ``copy_`` into a view of the parameter. The
loaders never look at values, so a recording-tensor dry run can replay them (see kvmove.sync.recording).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RankContext:
    """The slice of the model one engine rank holds."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    layers: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _check_shape(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: loaded slice {tuple(src.shape)} does not fit parameter slice {tuple(dst.shape)}")


def _check_dim(loaded: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ValueError(f"{what}: loaded tensor {tuple(loaded.shape)} has dim {dim} != {expected}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Whole-tensor copy for replicated parameters."""
    _check_shape(param.data, loaded_weight, "replicated parameter")
    param.data.copy_(loaded_weight)


def _param(ctx: RankContext, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=ctx.dtype, device=ctx.device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, ctx: RankContext, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(ctx, size)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class ReplicatedLinear(nn.Module):
    def __init__(self, ctx: RankContext, in_size: int, out_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(ctx, out_size, in_size)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = _param(ctx, out_size)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output dim split over tp: rank r holds rows [r·out/tp, (r+1)·out/tp)."""

    def __init__(self, ctx: RankContext, in_size: int, out_size: int, bias: bool = False, tp: bool = True) -> None:
        self.tp_size, self.tp_rank = (ctx.tp_size, ctx.tp_rank) if tp else (1, 0)
        super().__init__(ctx, in_size, out_size // self.tp_size, bias)
        for p in self.parameters():
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        _check_dim(loaded_weight, 0, size * self.tp_size, "column-parallel weight")
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        _check_shape(param.data, src, "column-parallel weight")
        param.data.copy_(src)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused along dim 0 (``gate_up_proj``, MLA's ``fused_qkv_a_proj``)."""

    def __init__(self, ctx: RankContext, in_size: int, out_sizes: list[int], bias: bool = False, tp: bool = True):
        self.out_sizes = list(out_sizes)
        super().__init__(ctx, in_size, sum(out_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        size = self.out_sizes[shard_id] // self.tp_size
        _check_dim(loaded_weight, 0, self.out_sizes[shard_id], f"merged shard {shard_id}")
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, src, f"merged shard {shard_id}")
        dst.copy_(src)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v fused along dim 0; KV heads replicate over tp ranks when tp > num_kv_heads (vLLM's rule)."""

    def __init__(self, ctx: RankContext, hidden: int, head_dim: int, heads: int, kv_heads: int, bias: bool):
        self.head_dim = head_dim
        self.q_heads = heads // ctx.tp_size
        self.kv_heads = max(1, kv_heads // ctx.tp_size)
        self.kv_replicas = max(1, ctx.tp_size // kv_heads)
        out = (self.q_heads + 2 * self.kv_heads) * head_dim * ctx.tp_size
        super().__init__(ctx, hidden, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str = "q") -> None:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q, self.tp_rank * q
        else:
            offset = q if shard_id == "k" else q + kv
            size, start = kv, (self.tp_rank // self.kv_replicas) * kv
        heads = self.q_heads * self.tp_size if shard_id == "q" else self.kv_heads * self.tp_size // self.kv_replicas
        _check_dim(loaded_weight, 0, heads * self.head_dim, f"qkv shard {shard_id}")
        src = loaded_weight.narrow(0, start, size)
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, src, f"qkv shard {shard_id}")
        dst.copy_(src)

    @property
    def sizes(self) -> tuple[int, int, int]:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return q, kv, kv


class RowParallelLinear(nn.Module):
    """Input dim split over tp: rank r holds columns [r·in/tp, (r+1)·in/tp); outputs are partial sums."""

    def __init__(self, ctx: RankContext, in_size: int, out_size: int, tp: bool = True) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = (ctx.tp_size, ctx.tp_rank) if tp else (1, 0)
        self.weight = _param(ctx, out_size, in_size // self.tp_size)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[1]
        _check_dim(loaded_weight, 1, size * self.tp_size, "row-parallel weight")
        src = loaded_weight.narrow(1, self.tp_rank * size, size)
        _check_shape(param.data, src, "row-parallel weight")
        param.data.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def pad_vocab(vocab: int, tp: int, multiple: int = 64) -> int:
    """vLLM pads the vocabulary to a multiple of 64 per model, then splits it evenly over tp."""
    padded = -(-vocab // multiple) * multiple
    return -(-padded // tp) * tp


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocabulary split over tp; padding rows stay zero and are never loaded."""

    def __init__(self, ctx: RankContext, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.per_rank = pad_vocab(vocab, ctx.tp_size) // ctx.tp_size
        self.start = ctx.tp_rank * self.per_rank
        self.weight = _param(ctx, self.per_rank, hidden)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @property
    def loaded_rows(self) -> int:
        return max(0, min(self.per_rank, self.vocab - self.start))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        rows = self.loaded_rows
        _check_dim(loaded_weight, 0, self.vocab, "vocab-parallel weight")
        if rows == 0:
            return
        src = loaded_weight.narrow(0, self.start, rows)
        dst = param.data[:rows]
        _check_shape(dst, src, "vocab shard")
        dst.copy_(src)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mask = (local < 0) | (local >= self.loaded_rows)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        return out.masked_fill(mask.unsqueeze(-1), 0)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)[..., : self.loaded_rows]


class FusedMoE(nn.Module):
    """All experts of a layer in two fused tensors, vLLM's ``w13_weight`` [E, 2·I, h] and ``w2_weight`` [E, h, I].

    With ep > 1 a rank holds whole experts [ep_rank·E/ep, (ep_rank+1)·E/ep); with ep == 1 it holds every
    expert, each split over tp (w1/w3 by rows, w2 by columns).
    """

    def __init__(self, ctx: RankContext, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        if ctx.ep_size > 1:
            self.local_experts = num_experts // ctx.ep_size
            self.first_expert = ctx.ep_rank * self.local_experts
            self.tp_size, self.tp_rank = 1, 0
        else:
            self.local_experts, self.first_expert = num_experts, 0
            self.tp_size, self.tp_rank = ctx.tp_size, ctx.tp_rank
        self.inter = inter // self.tp_size
        self.w13_weight = _param(ctx, self.local_experts, 2 * self.inter, hidden)
        self.w2_weight = _param(ctx, self.local_experts, hidden, self.inter)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def local_index(self, expert_id: int) -> int | None:
        local = expert_id - self.first_expert
        return local if 0 <= local < self.local_experts else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int) -> bool:
        local = self.local_index(expert_id)
        if local is None:
            return False
        expert = param.data[local]
        _check_dim(loaded_weight, 1 if shard_id == "w2" else 0, self.inter * self.tp_size, f"expert {shard_id}")
        if shard_id == "w2":
            src = loaded_weight.narrow(1, self.tp_rank * self.inter, self.inter)
            dst = expert
        else:
            src = loaded_weight.narrow(0, self.tp_rank * self.inter, self.inter)
            dst = expert.narrow(0, 0 if shard_id == "w1" else self.inter, self.inter)
        _check_shape(dst, src, f"expert {expert_id} {shard_id}")
        dst.copy_(src)
        return True
