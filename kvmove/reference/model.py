"""The reference inference model: one engine rank's parameters in vLLM's fused layout, for any checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from kvmove.errors import ModelError
from kvmove.models.checkpoint import engine_format, is_block_quantized
from kvmove.models.config import ModelConfig
from kvmove.models.experts import fused_experts
from kvmove.models.layout import EngineCoord, EngineLayout
from kvmove.models.table import table_of
from kvmove.models.tensors import TensorMeta
from kvmove.reference.layers import (
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
    head_parallel_param,
)
from kvmove.reference.mapping import (
    COLUMN_PARALLEL,
    EXPERT_NAME,
    EXPERT_PARAMS,
    HEAD_PARALLEL,
    ROW_PARALLEL,
    TIED,
    VOCAB_PARALLEL,
    fused_expert_of,
    pieces_of,
    stacked_of,
)


class ReferenceModel(nn.Module):
    """Parameters of one engine rank, built from the checkpoint's tensor table through the declarative mapping
    (kvmove.reference.mapping); ``load_weights`` (kvmove.reference.loader) fills them.

    The module tree follows the checkpoint's names (``model.layers.N.self_attn.qkv_proj``...): a stage holds the
    tensors before the decoder layers if it is the first, its layers, and the tensors after them if it is the last.
    """

    model: Any
    """The backbone: ModuleDicts down to the layer modules (``model.layers["3"].self_attn.qkv_proj``)."""
    lm_head: Any

    def __init__(self, cfg: ModelConfig, ctx: RankContext) -> None:
        super().__init__()
        self.config, self.ctx = cfg, ctx
        table = table_of(cfg)
        held = list(table.head) if ctx.first_stage else []
        for i in ctx.layers:
            held += table.layer(i)
        self.tied = False
        if ctx.last_stage:
            held += table.tail
            embed = next((t for t in table.head if t.name == TIED[0]), None)
            if embed is not None and all(t.name != TIED[1] for t in table.tail):
                self.tied = True
                held.append(TensorMeta(TIED[1], embed.shape, embed.dtype))
        for path, module in build_modules(cfg, ctx, held):
            _attach(self, path, module)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from kvmove.reference.loader import load_weights

        return load_weights(self, weights)


Built = tuple[str, "nn.Module | nn.Parameter"]


def build_modules(cfg: ModelConfig, ctx: RankContext, tensors: Sequence[TensorMeta]) -> list[Built]:
    """(path, module or parameter) for every engine module the checkpoint tensors ``tensors`` fill."""
    groups: dict[str, dict[str, TensorMeta]] = {}
    experts: dict[str, dict[int, dict[str, TensorMeta]]] = {}
    every: dict[str, dict[str, TensorMeta]] = {}  # layers whose checkpoint holds all experts in one tensor
    order: dict[str, int] = {}  # path -> its first tensor's position: modules are built in checkpoint order
    for i, t in enumerate(tensors):
        m, f = EXPERT_NAME.match(t.name), fused_expert_of(t.name)
        if m is not None and m["proj"] in EXPERT_PARAMS:
            experts.setdefault(m["prefix"], {}).setdefault(int(m["expert"]), {})[EXPERT_PARAMS[m["proj"]]] = t
            order.setdefault(m["prefix"], i)
            continue
        if f is not None:
            every.setdefault(f.prefix, {})[f.target.param] = t
            order.setdefault(f.prefix, i)
            continue
        path, _, leaf = t.name.rpartition(".")
        groups.setdefault(path, {})[leaf] = t
        order.setdefault(path, i)
    todo: list[tuple[int, str, Callable[[], nn.Module | nn.Parameter]]] = []
    for prefix, by_expert in experts.items():
        inter, hidden = by_expert[min(by_expert)]["w1"].shape
        todo.append((order[prefix], prefix, partial(FusedMoE, ctx, len(by_expert), hidden, inter)))
    for prefix, params in every.items():
        todo.append((order[prefix], prefix, partial(_fused_experts, cfg, ctx, params)))
    done: set[str] = set()
    for path, leaves in groups.items():
        if path in done:
            continue
        parent, _, leaf = path.rpartition(".")
        rule = stacked_of(leaf)
        siblings = [f"{parent}.{s.piece}" for s in pieces_of(rule.fused)] if rule else []
        if rule and all(s in groups for s in siblings):
            fused, parts = f"{parent}.{rule.fused}", [groups[s] for s in siblings]
            todo.append((min(order[s] for s in siblings), fused, partial(_fused, cfg, ctx, rule.fused, parts, fused)))
            done.update(siblings)
        elif "weight" in leaves:
            todo.append((order[path], path, partial(_single, cfg, ctx, path, leaf, leaves)))
        else:  # parameters held by a module directly (attention sinks)
            todo += [(order[path], f"{path}.{n}", partial(_direct, cfg, ctx, n, t)) for n, t in leaves.items()]
    todo.sort(key=lambda item: item[0])  # NOTE: built in checkpoint order (the first refusal is the first tensor's)
    return [(path, build()) for _, path, build in todo]


def _fused_experts(cfg: ModelConfig, ctx: RankContext, params: dict[str, TensorMeta]) -> nn.Module:
    """A FusedMoE filled from tensors that hold every expert of the layer (``gate_up_proj`` ``[E, h, 2·I]``...)."""
    if set(params) - {"w13_bias", "w2_bias"} != {"w13_weight", "w2_weight"}:
        raise ModelError(f"the reference engine needs both gate_up_proj and down_proj of fused experts, got {params}")
    experts, hidden, inter2 = params["w13_weight"].shape
    bias, interleaved = "w13_bias" in params, fused_experts(cfg).interleaved
    return FusedMoE(ctx, experts, hidden, inter2 // 2, fused=True, bias=bias, interleaved=interleaved)


def _label(path: str) -> str:
    parts = path.split(".")
    return ".".join(parts[3:]) if len(parts) > 3 and parts[1] == "layers" else path


def _fused(cfg: ModelConfig, ctx: RankContext, fused: str, pieces: list[dict[str, TensorMeta]], path: str) -> nn.Module:
    label = _label(path)
    first = pieces[0]["weight"]
    hidden, bias = first.shape[1], "bias" in pieces[0]
    if fused == "qkv_proj":
        heads = cfg.num_attention_heads
        head_dim = first.shape[0] // heads
        return QKVParallelLinear(ctx, hidden, head_dim, heads, cfg.num_key_value_heads, bias, label)
    rows = [p["weight"].shape[0] for p in pieces]
    return MergedColumnParallelLinear(ctx, hidden, rows, bias, tp=fused != "fused_qkv_a_proj", label=label)


def _single(cfg: ModelConfig, ctx: RankContext, path: str, leaf: str, leaves: dict[str, TensorMeta]) -> nn.Module:
    weight, bias = leaves["weight"], "bias" in leaves
    vocab = VOCAB_PARALLEL.get(path)
    if vocab is not None:
        cls = VocabParallelEmbedding if vocab == "embedding" else ParallelLMHead
        return cls(ctx, weight.shape[0], weight.shape[1])
    if len(weight.shape) == 1 and set(leaves) == {"weight"}:
        return RMSNorm(ctx, weight.shape[0], cfg.rms_norm_eps)
    if len(weight.shape) != 2:
        raise ModelError(f"the reference engine has no layer for tensor {weight.name} {weight.shape}")
    out_size, in_size = weight.shape
    if leaf in ROW_PARALLEL:
        module: nn.Module = RowParallelLinear(ctx, in_size, out_size, bias=bias, label=_label(path))
    elif leaf in COLUMN_PARALLEL:
        module = ColumnParallelLinear(ctx, in_size, out_size, bias, label=_label(path))
    else:
        module = ReplicatedLinear(ctx, in_size, out_size, bias, quantized=is_block_quantized(weight.name))
    for name, t in leaves.items():  # e.g. a router's e_score_correction_bias
        if name not in ("weight", "bias"):
            module.register_parameter(name, _direct(cfg, ctx, name, t))
    return module


def _direct(cfg: ModelConfig, ctx: RankContext, name: str, t: TensorMeta) -> nn.Parameter:
    if name in HEAD_PARALLEL:
        return head_parallel_param(ctx, t.shape[0])
    param = nn.Parameter(torch.zeros(t.shape, dtype=ctx.dtype, device=ctx.device), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


def _attach(root: nn.Module, path: str, item: nn.Module | nn.Parameter) -> None:
    """Put ``item`` at dotted ``path`` under ``root``, creating containers (ModuleDicts) on the way."""
    node = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = node._modules.get(part)
        if child is None:
            child = nn.ModuleDict()
            node.add_module(part, child)
        node = child
    if isinstance(item, nn.Parameter):
        node.register_parameter(parts[-1], item)
    else:
        node.add_module(parts[-1], item)


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
