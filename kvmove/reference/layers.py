"""Parallel layers of the reference engine, with vLLM's fused parameter layouts and weight loaders.

Each parameter carries a ``weight_loader(param, loaded_weight, ...)`` written the way engine loaders are:
``narrow``/``chunk``/index into the loaded HF tensor, then ``copy_`` into a view of the parameter. The
loaders never look at values, so a recording-tensor dry run can replay them (see kvmove.sync.planning.recording).

With ``RankContext.weight_block`` set, linear layers hold vLLM's block-FP8 layout: ``weight`` in float8_e4m3fn
and ``weight_scale_inv`` (float32, one entry per block of the rank's weight), which the same loaders fill from
the checkpoint's ``weight_scale_inv`` by counting rows and columns in blocks (``_units``). As in vLLM, a layout
whose TP split cuts a block (or a fused partition that does not start on one) is refused at construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvmove.errors import LayoutError
from kvmove.quant.fp8 import FP8_DTYPE, scale_shape


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
    weight_block: int | None = None
    """Linear weights in block FP8 with blocks of this size (None: in ``dtype``)."""

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _check_shape(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: loaded slice {tuple(src.shape)} does not fit parameter slice {tuple(dst.shape)}")
    if (dst.dtype == FP8_DTYPE) != (src.dtype == FP8_DTYPE):
        raise ValueError(
            f"{what}: loaded {src.dtype} into a {dst.dtype} parameter; an FP8 engine loads the FP8 checkpoint, "
            "a BF16 engine the BF16 one (kvmove.models.checkpoint.engine_checkpoint)"
        )


def _check_dim(loaded: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ValueError(f"{what}: loaded tensor {tuple(loaded.shape)} has dim {dim} != {expected}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Whole-tensor copy for replicated parameters."""
    _check_shape(param.data, loaded_weight, "replicated parameter")
    param.data.copy_(loaded_weight)


def _param(ctx: RankContext, *shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype or ctx.dtype, device=ctx.device), requires_grad=False)


def _units(param: nn.Parameter, n: int) -> int:
    """``n`` weight rows (or columns) counted in ``param``'s entries: blocks for a block scale, else elements."""
    block: int = getattr(param, "block", 1)
    return -(-n // block)


def _weights(module: nn.Module, ctx: RankContext, name: str, *shape: int, quantized: bool = True) -> None:
    """Register weight ``name`` of ``shape`` ([experts,] out, in); in block FP8 plus ``<name>_scale_inv`` if set."""
    if not (quantized and ctx.weight_block):
        module.register_parameter(name, _param(ctx, *shape))
        return
    module.register_parameter(name, _param(ctx, *shape, dtype=FP8_DTYPE))
    scale = _param(ctx, *scale_shape(shape, ctx.weight_block), dtype=torch.float32)
    scale.block = ctx.weight_block  # type: ignore[attr-defined]
    module.register_parameter(name + "_scale_inv", scale)


def _check_blocks(ctx: RankContext, label: str, what: str, sizes: Sequence[int]) -> None:
    """vLLM's rule for block-FP8 layers: each TP shard, and each fused partition but the last, is whole blocks."""
    block = ctx.weight_block
    bad = [n for n in sizes if block and n % block]
    if block and bad:
        raise LayoutError(
            f"engine tp={ctx.tp_size} with FP8 weights: {label} {what} is {bad[0]} per rank, not a multiple of "
            f"the {block}x{block} quantization block (vLLM refuses this split too)"
        )


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
    weight: nn.Parameter

    def __init__(
        self, ctx: RankContext, in_size: int, out_size: int, bias: bool = False, quantized: bool = True
    ) -> None:
        super().__init__()
        _weights(self, ctx, "weight", out_size, in_size, quantized=quantized)
        for p in self.parameters():
            p.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = _param(ctx, out_size)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output dim split over tp: rank r holds rows [r·out/tp, (r+1)·out/tp)."""

    def __init__(
        self, ctx: RankContext, in_size: int, out_size: int, bias: bool = False, tp: bool = True, label: str = ""
    ) -> None:
        self.tp_size, self.tp_rank = (ctx.tp_size, ctx.tp_rank) if tp else (1, 0)
        super().__init__(ctx, in_size, out_size // self.tp_size, bias)
        self._check(ctx, label or type(self).__name__)
        for p in self.parameters():
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def _check(self, ctx: RankContext, label: str) -> None:
        if self.tp_size > 1:
            _check_blocks(ctx, label, "output rows", [self.weight.shape[0]])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        _check_dim(loaded_weight, 0, size * self.tp_size, "column-parallel weight")
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        _check_shape(param.data, src, "column-parallel weight")
        param.data.copy_(src)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused along dim 0 (``gate_up_proj``, MLA's ``fused_qkv_a_proj``)."""

    def __init__(
        self,
        ctx: RankContext,
        in_size: int,
        out_sizes: list[int],
        bias: bool = False,
        tp: bool = True,
        label: str = "",
    ):
        self.out_sizes = list(out_sizes)
        super().__init__(ctx, in_size, sum(out_sizes), bias, tp, label)

    def _check(self, ctx: RankContext, label: str) -> None:
        parts = [n // self.tp_size for n in self.out_sizes]
        _check_blocks(ctx, label, "fused output partition", parts if self.tp_size > 1 else parts[:-1])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int = 0) -> None:
        offset = _units(param, sum(self.out_sizes[:shard_id]) // self.tp_size)
        size = _units(param, self.out_sizes[shard_id] // self.tp_size)
        _check_dim(loaded_weight, 0, _units(param, self.out_sizes[shard_id]), f"merged shard {shard_id}")
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, src, f"merged shard {shard_id}")
        dst.copy_(src)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v fused along dim 0; KV heads replicate over tp ranks when tp > num_kv_heads (vLLM's rule)."""

    def __init__(
        self, ctx: RankContext, hidden: int, head_dim: int, heads: int, kv_heads: int, bias: bool, label: str = ""
    ):
        self.head_dim = head_dim
        self.q_heads = heads // ctx.tp_size
        self.kv_heads = max(1, kv_heads // ctx.tp_size)
        self.kv_replicas = max(1, ctx.tp_size // kv_heads)
        out = (self.q_heads + 2 * self.kv_heads) * head_dim * ctx.tp_size
        super().__init__(ctx, hidden, out, bias, label=label)

    def _check(self, ctx: RankContext, label: str) -> None:
        parts = list(self.sizes)
        _check_blocks(ctx, label, "q/k/v partition", parts if self.tp_size > 1 else parts[:-1])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str = "q") -> None:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q, self.tp_rank
        else:
            offset, size, index = (q if shard_id == "k" else q + kv), kv, self.tp_rank // self.kv_replicas
        heads = self.q_heads * self.tp_size if shard_id == "q" else self.kv_heads * self.tp_size // self.kv_replicas
        _check_dim(loaded_weight, 0, _units(param, heads * self.head_dim), f"qkv shard {shard_id}")
        offset, size = _units(param, offset), _units(param, size)
        src = loaded_weight.narrow(0, index * size, size)
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, src, f"qkv shard {shard_id}")
        dst.copy_(src)

    @property
    def sizes(self) -> tuple[int, int, int]:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return q, kv, kv


class RowParallelLinear(nn.Module):
    """Input dim split over tp: rank r holds columns [r·in/tp, (r+1)·in/tp); outputs are partial sums."""

    weight: nn.Parameter

    def __init__(
        self, ctx: RankContext, in_size: int, out_size: int, tp: bool = True, label: str = "", bias: bool = False
    ) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = (ctx.tp_size, ctx.tp_rank) if tp else (1, 0)
        _weights(self, ctx, "weight", out_size, in_size // self.tp_size)
        if self.tp_size > 1:
            _check_blocks(ctx, label or "RowParallelLinear", "input columns", [in_size // self.tp_size])
        for p in self.parameters():
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:  # added once after the partial sums: every rank holds it whole
            self.bias = _param(ctx, out_size)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[1]
        _check_dim(loaded_weight, 1, size * self.tp_size, "row-parallel weight")
        src = loaded_weight.narrow(1, self.tp_rank * size, size)
        _check_shape(param.data, src, "row-parallel weight")
        param.data.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def head_parallel_param(ctx: RankContext, heads: int) -> nn.Parameter:
    """A per-head parameter (attention sinks): rank r holds heads [r·heads/tp, (r+1)·heads/tp)."""
    size = heads // ctx.tp_size
    param = _param(ctx, size)

    def load(p: nn.Parameter, loaded: torch.Tensor) -> None:
        _check_dim(loaded, 0, heads, "head-parallel parameter")
        src = loaded.narrow(0, ctx.tp_rank * size, size)
        _check_shape(p.data, src, "head-parallel parameter")
        p.data.copy_(src)

    param.weight_loader = load  # type: ignore[attr-defined]
    return param


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
    """All experts of a layer in two fused tensors, vLLM's ``w13_weight`` [E, 2·I, h] and ``w2_weight`` [E, h, I]
    (with ``bias``: ``w13_bias`` [E, 2·I] and ``w2_bias`` [E, h]).

    With ep > 1 a rank holds whole experts [ep_rank·E/ep, (ep_rank+1)·E/ep); with ep == 1 it holds every
    expert, each split over tp (w1/w3 by rows, w2 by columns; ``w2_bias`` whole, added once after the partial
    sums). A checkpoint holds the experts one tensor per expert and projection (``weight_loader``) or one tensor
    per layer and projection (``fused_loader``: ``[E, in, out]``); in ``w13``, gate and up lie as the checkpoint
    has them (``interleaved``: gate0, up0, gate1, ...; else gate rows, then up rows).
    """

    w13_weight: nn.Parameter
    w2_weight: nn.Parameter

    def __init__(
        self,
        ctx: RankContext,
        num_experts: int,
        hidden: int,
        inter: int,
        *,
        fused: bool = False,
        bias: bool = False,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        if ctx.ep_size > 1:
            self.local_experts = num_experts // ctx.ep_size
            self.first_expert = ctx.ep_rank * self.local_experts
            self.tp_size, self.tp_rank = 1, 0
        else:
            self.local_experts, self.first_expert = num_experts, 0
            self.tp_size, self.tp_rank = ctx.tp_size, ctx.tp_rank
        self.inter, self.interleaved = inter // self.tp_size, interleaved
        if fused and ctx.weight_block:
            raise LayoutError("the reference engine holds fused expert checkpoints (gpt-oss, Llama 4) in BF16 only")
        _check_blocks(ctx, "mlp.experts", "intermediate size", [self.inter])
        _weights(self, ctx, "w13_weight", self.local_experts, 2 * self.inter, hidden)
        _weights(self, ctx, "w2_weight", self.local_experts, hidden, self.inter)
        if bias:
            self.w13_bias = _param(ctx, self.local_experts, 2 * self.inter)
            self.w2_bias = _param(ctx, self.local_experts, hidden)
        for p in self.parameters():
            p.weight_loader = self.fused_loader if fused else self.weight_loader  # type: ignore[attr-defined]

    def local_index(self, expert_id: int) -> int | None:
        local = expert_id - self.first_expert
        return local if 0 <= local < self.local_experts else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int) -> bool:
        local = self.local_index(expert_id)
        if local is None:
            return False
        expert, inter = param.data[local], _units(param, self.inter)
        dim = 1 if shard_id == "w2" else 0
        _check_dim(loaded_weight, dim, _units(param, self.inter * self.tp_size), f"expert {shard_id}")
        src = loaded_weight.narrow(dim, self.tp_rank * inter, inter)
        dst = expert if shard_id == "w2" else expert.narrow(0, 0 if shard_id == "w1" else inter, inter)
        _check_shape(dst, src, f"expert {expert_id} {shard_id}")
        dst.copy_(src)
        return True

    def fused_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """Load a tensor holding every expert (``[E, in, out]`` weight or ``[E, out]`` bias): this rank's experts,
        each cut to its part of the intermediate dim, weights turned to ``[out, in]``."""
        _check_dim(loaded, 0, self.num_experts, "fused experts")
        experts = loaded.narrow(0, self.first_expert, self.local_experts)
        weight = experts.dim() == 3
        if shard_id == "w2":
            src = experts.narrow(1, self.tp_rank * self.inter, self.inter).transpose(1, 2) if weight else experts
            _check_shape(param.data, src, "fused experts w2")
            param.data.copy_(src)
            return
        last, n = experts.dim() - 1, self.inter
        if self.interleaved:  # the units a rank holds are one block of gate/up column pairs
            pieces = [(experts.narrow(last, 2 * self.tp_rank * n, 2 * n), param.data)]
        else:  # gate in the first half, up in the second: a block of each
            halves = enumerate(experts.chunk(2, dim=last))
            pieces = [(h.narrow(last, self.tp_rank * n, n), param.data.narrow(1, i * n, n)) for i, h in halves]
        for src, dst in pieces:
            src = src.transpose(1, 2) if weight else src
            _check_shape(dst, src, "fused experts w13")
            dst.copy_(src)
