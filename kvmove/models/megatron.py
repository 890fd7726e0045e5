"""megatron-core's parameter layout of the supported GQA architectures, and its conversion to and from HF names.

Names and shapes are those of a megatron-core GPT model built with Transformer Engine layer specs, as
Megatron-Bridge maps them for Qwen3-MoE, Qwen3 and Qwen2 (docs/notes/megatron.md cites the rules):

- ``embedding.word_embeddings.weight`` and ``output_layer.weight``: the vocabulary padded to a multiple of
  ``d·tp`` rows, ``d`` the largest power of two up to 128 dividing the vocabulary (Bridge's rule);
- ``decoder.layers.N.self_attention.linear_qkv.weight``: Q, K and V fused and interleaved per query group
  (``[q_1..q_n, k, v]`` for each of the G groups), with the input norm fused in as ``.layer_norm_weight``;
  ``linear_proj``, ``q_layernorm``/``k_layernorm``;
- dense MLP: ``mlp.linear_fc1.weight`` (gate and up fused, the post-attention norm fused in as
  ``.layer_norm_weight``) and ``mlp.linear_fc2.weight``;
- MoE: ``pre_mlp_layernorm.weight``, ``mlp.router.weight`` and each expert's ``linear_fc1``/``linear_fc2``, as
  grouped-GEMM weights ``mlp.experts.linear_fc1.weightE`` or per-local-expert ``mlp.experts.local_experts.E.``;
- ``decoder.final_layernorm.weight``.

Layer and expert numbers are global (as in megatron-core's sharded state dict and Bridge's export): a pipeline
stage's local layer ``i`` and an EP rank's local expert ``e`` appear under their global indices.
A *full* tensor is what gathering its TP (experts: ETP) shards in rank order along the split dim gives. For
``linear_fc1`` every shard is ``[gate_r; up_r]``, so the full tensor interleaves gate and up per shard and its
layout depends on the trainer's TP size; its conversion to HF accounts for that.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from fnmatch import fnmatchcase

import torch

from kvmove.errors import ModelError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import TrainerLayout
from kvmove.models.table import is_moe_layer, table_of
from kvmove.models.tensors import TensorMeta, expert_of, layer_of


def vocab_padded(cfg: ModelConfig, tp: int) -> int:
    """Rows of the embedding and output layer: megatron-core pads the vocabulary to a multiple of ``d·tp``."""
    d = 128
    while cfg.vocab_size % d:
        d //= 2
    step = d * tp
    return -(-cfg.vocab_size // step) * step


def _check(cfg: ModelConfig) -> None:
    """The format names every tensor of ``cfg``'s checkpoint (GQA models in HF's Llama/Qwen spelling)."""
    if cfg.is_mla or cfg.n_shared_experts:
        raise ModelError(f"the megatron checkpoint format covers GQA models without shared experts, not {cfg.name}")
    known = {*_LAYER_LEAVES.values(), *_FUSED_LEAVES}
    for _, tensors in table_of(cfg).templates.values():
        for t in tensors:
            leaf = _EXPERT_INDEX.sub(".experts.E.", t.name.split(".", 3)[3])
            if leaf not in known:
                raise ModelError(f"the megatron checkpoint format has no megatron-core name for {cfg.name}'s {t.name}")


class MegatronLayout:
    """megatron-core names and shapes of one model (``grouped``: grouped-GEMM experts, else per local expert)."""

    def __init__(self, grouped: bool = True) -> None:
        self.grouped = grouped

    # -- names and shapes ---------------------------------------------------------------------------------
    def tensors(
        self, cfg: ModelConfig, trainer: TrainerLayout, layers: Iterable[int] | None = None
    ) -> list[TensorMeta]:
        """The full tensors, in megatron-core's state-dict order (see module docstring)."""
        _check(cfg)
        h, vp = cfg.hidden_size, vocab_padded(cfg, trainer.tp)
        wanted = range(cfg.num_hidden_layers) if layers is None else sorted(set(layers))
        out = [TensorMeta("embedding.word_embeddings.weight", (vp, h))]
        for i in wanted:
            out += self._layer(cfg, i)
        out.append(TensorMeta("decoder.final_layernorm.weight", (h,)))
        if not cfg.tie_word_embeddings:
            out.append(TensorMeta("output_layer.weight", (vp, h)))
        return out

    def _layer(self, cfg: ModelConfig, i: int) -> list[TensorMeta]:
        p, h, d = f"decoder.layers.{i}.", cfg.hidden_size, cfg.head_dim
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
        a = p + "self_attention."
        out = [TensorMeta(a + "linear_proj.weight", (h, cfg.num_attention_heads * d))]
        out += [TensorMeta(a + "linear_qkv.layer_norm_weight", (h,)), TensorMeta(a + "linear_qkv.weight", (qkv, h))]
        if cfg.attention_bias:
            out.append(TensorMeta(a + "linear_qkv.bias", (qkv,)))
        if cfg.qk_norm:
            out += [TensorMeta(a + "q_layernorm.weight", (d,)), TensorMeta(a + "k_layernorm.weight", (d,))]
        if not is_moe_layer(cfg, i):
            out.append(TensorMeta(p + "mlp.linear_fc1.layer_norm_weight", (h,)))
            out.append(TensorMeta(p + "mlp.linear_fc1.weight", (2 * cfg.intermediate_size, h)))
            out.append(TensorMeta(p + "mlp.linear_fc2.weight", (h, cfg.intermediate_size)))
            return out
        out += [
            TensorMeta(p + "pre_mlp_layernorm.weight", (h,)),
            TensorMeta(p + "mlp.router.weight", (cfg.num_experts, h)),
        ]
        inter = cfg.moe_intermediate_size
        for proj, shape in (("linear_fc1", (2 * inter, h)), ("linear_fc2", (h, inter))):
            out += [TensorMeta(self.expert_name(p, e, proj), shape) for e in range(cfg.num_experts)]
        return out

    def expert_name(self, prefix: str, expert: int, proj: str) -> str:
        if self.grouped:
            return f"{prefix}mlp.experts.{proj}.weight{expert}"
        return f"{prefix}mlp.experts.local_experts.{expert}.{proj}.weight"

    # -- to HF (views only) ------------------------------------------------------------------------------
    def to_hf(
        self, cfg: ModelConfig, trainer: TrainerLayout, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors as views of megatron-core ones (recordable: view, narrow, select, indexing, reshape)."""
        for name, t in named:
            yield from self._one_to_hf(cfg, trainer, name, t)

    def _one_to_hf(
        self, cfg: ModelConfig, trainer: TrainerLayout, name: str, t: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        layer, expert = layer_of(name), expert_of(name)
        if layer is None:
            hf = _OUTSIDE[name]
            yield hf, (t.narrow(0, 0, cfg.vocab_size) if name != "decoder.final_layernorm.weight" else t)
            return
        p = f"model.layers.{layer}."
        if expert is not None:
            q = f"{p}mlp.experts.{expert}."
            if ".linear_fc1." in name:
                yield from _split_fc1(t, trainer.etp, q + "gate_proj.weight", q + "up_proj.weight")
            else:
                yield q + "down_proj.weight", t
            return
        leaf = name.split(".", 3)[3]
        if leaf in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            yield from _split_qkv(cfg, t, p, leaf.rsplit(".", 1)[1])
        elif leaf == "mlp.linear_fc1.weight":
            yield from _split_fc1(t, trainer.tp, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        else:
            yield p + _LAYER_LEAVES[leaf], t

    # -- from HF (the import direction, as Megatron-Bridge loads a checkpoint) -----------------------------
    def from_hf(
        self, cfg: ModelConfig, trainer: TrainerLayout, hf: Callable[[str], torch.Tensor], meta: TensorMeta
    ) -> torch.Tensor:
        """The full megatron-core tensor ``meta`` built from HF tensors (``hf(name)``), as Megatron-Bridge imports
        a checkpoint (copies)."""
        name, layer, expert = meta.name, layer_of(meta.name), expert_of(meta.name)
        if layer is None:
            t = hf(_OUTSIDE[name])
            if t.shape[0] == meta.shape[0]:
                return t.clone()
            return torch.cat([t, t.new_zeros((meta.shape[0] - t.shape[0], *t.shape[1:]))])
        p = f"model.layers.{layer}."
        if expert is not None:
            q = f"{p}mlp.experts.{expert}."
            if ".linear_fc1." in name:
                return _merge_fc1(hf(q + "gate_proj.weight"), hf(q + "up_proj.weight"), trainer.etp)
            return hf(q + "down_proj.weight").clone()
        leaf = name.split(".", 3)[3]
        if leaf in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = leaf.rsplit(".", 1)[1]
            a = p + "self_attn."
            return _merge_qkv(cfg, *(hf(f"{a}{x}_proj.{kind}") for x in "qkv"))
        if leaf == "mlp.linear_fc1.weight":
            return _merge_fc1(hf(p + "mlp.gate_proj.weight"), hf(p + "mlp.up_proj.weight"), trainer.tp)
        return hf(p + _LAYER_LEAVES[leaf]).clone()


_OUTSIDE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER_LEAVES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
"""megatron-core leaf (after ``decoder.layers.N.``) -> HF leaf (after ``model.layers.N.``), one to one."""
_FUSED_LEAVES = (
    *(f"self_attn.{x}_proj.{k}" for x in "qkv" for k in ("weight", "bias")),
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    *(f"mlp.experts.E.{x}_proj.weight" for x in ("gate", "up", "down")),
)
"""HF leaves the format fuses (q/k/v into linear_qkv, gate/up into linear_fc1) or holds per expert."""
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _split_qkv(cfg: ModelConfig, t: torch.Tensor, prefix: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Q, K, V out of the per-group interleave ``[q_1..q_n, k, v] x G`` (Bridge's ``split_qkv_weights``)."""
    g, d = cfg.num_key_value_heads, cfg.head_dim
    n = cfg.num_attention_heads // g
    grouped = t.view(g, n + 2, d, *t.shape[1:])
    rows = (-1, *t.shape[1:])
    a = prefix + "self_attn."
    yield f"{a}q_proj.{kind}", grouped[:, :n].reshape(rows)
    yield f"{a}k_proj.{kind}", grouped.select(1, n).reshape(rows)
    yield f"{a}v_proj.{kind}", grouped.select(1, n + 1).reshape(rows)


def _split_fc1(t: torch.Tensor, tp: int, gate: str, up: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Gate and up out of the TP shards ``[gate_r; up_r]`` gathered in rank order (Bridge's ``GatedMLPMapping``)."""
    shards = t.view(tp, 2, t.shape[0] // (2 * tp), *t.shape[1:])
    rows = (-1, *t.shape[1:])
    yield gate, shards.select(1, 0).reshape(rows)
    yield up, shards.select(1, 1).reshape(rows)


def _merge_qkv(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = cfg.num_key_value_heads, cfg.head_dim
    n = cfg.num_attention_heads // g
    tail = tuple(q.shape[1:])
    parts = []
    for i in range(g):
        parts += [
            q.view(g * n, d, *tail)[i * n : (i + 1) * n],
            k.view(g, d, *tail)[i : i + 1],
            v.view(g, d, *tail)[i : i + 1],
        ]
    return torch.cat(parts).reshape(-1, *tail)


def _merge_fc1(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    return torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)])


_SPLITS: tuple[tuple[str, int | None], ...] = (
    ("embedding.word_embeddings.weight", 0),
    ("output_layer.weight", 0),
    ("*.linear_qkv.weight", 0),
    ("*.linear_qkv.bias", 0),
    ("*.linear_fc1.weight", 0),
    ("*.linear_proj.weight", 1),
    ("*.linear_fc2.weight", 1),
    ("*layernorm*", None),
    ("*.layer_norm_weight", None),
    ("*.mlp.router.weight", None),
)
"""megatron-core tensor (glob) -> its TP split dim (None: replicated); experts split over ETP the same way."""
_EXPERT_SPLITS: tuple[tuple[str, int], ...] = (("*.linear_fc1.*", 0), ("*.linear_fc2.*", 1))


def megatron_split(cfg: ModelConfig, name: str) -> tuple[int | None, str]:
    """(split dim or None if replicated, "tp" or "etp") of megatron-core tensor ``name`` under TP/ETP."""
    if expert_of(name) is not None:
        dim = next((d for pattern, d in _EXPERT_SPLITS if fnmatchcase(name, pattern)), None)
        if dim is not None:
            return dim, "etp"
    for pattern, split in _SPLITS:
        if fnmatchcase(name, pattern):
            return split, "tp"
    raise ModelError(f"no megatron-core sharding rule for tensor {name}")
