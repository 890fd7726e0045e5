"""Who holds which part of each HF tensor, in the simulator's terms, from the rules' owners.

The trainer's Megatron split is the planner's (:func:`kvmove.sync.planning.ownership.shard_rule`), which FP8
tensors exist is the checkpoint's (:func:`kvmove.models.checkpoint.is_block_quantized`) and the scale format is
``kvmove.quant``'s; this module only restates them as a :class:`Split` per tensor. The engine side is vLLM's
split of one replica (TP shards, K/V heads replicated past the KV head count, whole experts per EP rank), which
tests check against the real plans' bytes per engine rank (``kvmove sync-weights --dry-run``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kvmove.models.checkpoint import is_block_quantized
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.quant.fp8 import scale_shape
from kvmove.sync.planning.direct import cheap_spans
from kvmove.sync.planning.ownership import shard_rule

_ROW = ("o_proj", "down_proj")
"""Row-parallel projections in vLLM's engine split (split on dim 1); the others split on dim 0."""


class Split(NamedTuple):
    """How one side splits a tensor: along ``dim`` into ``parts`` (dim None: every holder keeps all of it).

    ``keep`` is the fraction one keeping rank holds (1/parts, or 1/kv_heads for K/V replicated over TP ranks);
    ``owner`` is the expert-parallel index of the ranks that hold an expert (None: every rank of the stage).
    """

    stage: int
    dim: int | None
    parts: int
    keep: float
    owner: int | None


def role(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj``; ``...mlp.gate.e_score_correction_bias`` -> gate."""
    parts = name.split(".")
    if name.endswith("e_score_correction_bias"):
        return "gate"
    return parts[-2] if len(parts) >= 2 else name


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the FP8 checkpoint stores ``name`` in block FP8: the checkpoint's own rule
    (:func:`kvmove.models.checkpoint.is_block_quantized`), for matrices."""
    return len(shape) == 2 and is_block_quantized(name)


def wire_bytes(name: str, shape: tuple[int, ...], dtype: str, block: int = 128) -> int:
    """Bytes of the full tensor as sent: BF16, or FP8 e4m3 plus FP32 block scales (``kvmove.quant.scale_shape``)
    for the tensors the FP8 checkpoint quantizes."""
    numel = math.prod(shape)
    if dtype == "bf16" or not quantizable(name, shape):
        return 2 * numel
    return numel + 4 * math.prod(scale_shape(shape, block))


def trainer_split(cfg: ModelConfig, layout: TrainerLayout, name: str, layer: int | None, expert: int | None) -> Split:
    """The trainer's split as the planner states it (:func:`kvmove.sync.planning.ownership.shard_rule`), in the
    simulator's terms: TP (ETP for routed experts) parts along the rule's dim, the EP owner of ``expert``."""
    rule = shard_rule(cfg, layout, name)
    owner = None if expert is None else expert // (cfg.num_experts // layout.ep)
    parts = layout.etp if rule.group == "etp" else layout.tp
    if rule.dim is None or parts == 1:
        return Split(rule.stage, None, 1, 1.0, owner)
    return Split(rule.stage, rule.dim, parts, 1.0 / parts, owner)


def engine_split(cfg: ModelConfig, engine: EngineLayout, name: str, layer: int | None, expert: int | None) -> Split:
    """vLLM's split of one engine replica: TP shards, K/V heads replicated when tp > kv heads, whole experts
    per EP rank when ep > 1 (else experts TP-sharded); norms, router and MLA's down-projections replicated."""
    stage = _engine_stage(cfg, engine, name, layer)
    leaf = role(name)
    if expert is not None and engine.ep > 1:
        return Split(stage, None, 1, 1.0, expert // (cfg.num_experts // engine.ep))
    if leaf in ("q_a_proj", "kv_a_proj_with_mqa", "gate") or "norm" in leaf or engine.tp == 1:
        return Split(stage, None, 1, 1.0, None)
    if leaf in ("k_proj", "v_proj") and not cfg.is_mla and engine.tp > cfg.num_key_value_heads:
        kv = cfg.num_key_value_heads
        return Split(stage, 0, kv, 1.0 / kv, None)
    return Split(stage, 1 if leaf in _ROW else 0, engine.tp, 1.0 / engine.tp, None)


def slice_index(split: Split, engine: EngineLayout, tp_rank: int) -> int:
    """Which of ``split.parts`` slices the engine rank with this TP rank keeps."""
    if split.parts == 1:
        return 0
    return tp_rank * split.parts // engine.tp


def nested(engine: Split, trainer: Split) -> bool:
    """Whether every engine slice lies inside one trainer shard (so it can be read straight from that shard)."""
    if trainer.dim is None:
        return True
    return engine.dim == trainer.dim and engine.parts % trainer.parts == 0


def trainer_shard_of(engine: Split, trainer: Split, index: int) -> int:
    """The trainer shard holding engine slice ``index`` (see :func:`nested`)."""
    if trainer.dim is None:
        return 0
    return index // (engine.parts // trainer.parts)


def _engine_stage(cfg: ModelConfig, engine: EngineLayout, name: str, layer: int | None) -> int:
    if layer is None:
        return 0 if name == "model.embed_tokens.weight" else engine.pp - 1
    return _stage_of(engine.stage_layers(cfg), layer)


def _stage_of(ranges: list[range], layer: int) -> int:
    return next(i for i, r in enumerate(ranges) if layer in r)


class Piece(NamedTuple):
    """The part of one engine slice that lies in one trainer shard, and the byte runs reading it directly takes."""

    shard: int
    """The trainer shard (along the trainer's dim; 0 when the trainer keeps the tensor whole)."""
    fraction: float
    """Of the engine slice's bytes."""
    runs: int
    """Byte runs: one when the part is contiguous on both sides, else one per row."""
    run_bytes: int
    src_pitch: int
    """Bytes between the starts of two rows in the raw shard (a row of the shard)."""
    dst_pitch: int
    """Bytes between the starts of two rows in the engine's slice (a row of the slice)."""

    def spans(self) -> np.ndarray:
        """The piece's byte spans (shard offset, slice offset, nbytes), as ``DirectPlanner.spans`` lists them."""
        rows = np.arange(self.runs, dtype=np.int64)
        return np.stack([rows * self.src_pitch, rows * self.dst_pitch, np.full(self.runs, self.run_bytes)], axis=1)


def pieces(shape: tuple[int, ...], itemsize: int, engine: Split, trainer: Split, index: int) -> list[Piece]:
    """Engine slice ``index`` of a tensor cut along the trainer's shards, as the planner cuts a region
    (``kvmove.sync.planning.direct``: ``DirectPlanner.pieces``; one piece when the slice lies in one shard), each
    with the runs of its bytes between the raw shard (row-major in the arena) and the engine's slice (row-major in
    its parameter)."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    one_d = len(shape) == 1

    def box(split: Split, i: int) -> tuple[int, int, int, int]:
        if split.dim is None:
            return 0, rows, 0, cols
        if split.dim == 0 and not one_d:
            return i * rows // split.parts, (i + 1) * rows // split.parts, 0, cols
        return 0, rows, i * cols // split.parts, (i + 1) * cols // split.parts

    r0, r1, c0, c1 = box(engine, index)
    out = []
    for j in range(1 if trainer.dim is None else trainer.parts):
        t0, t1, s0, s1 = box(trainer, j)
        h, w = min(r1, t1) - max(r0, t0), min(c1, s1) - max(c0, s0)
        if h <= 0 or w <= 0:
            continue
        one = h == 1 or (w == s1 - s0 and w == c1 - c0)
        runs, run = (1, h * w) if one else (h, w)
        fraction = h * w / ((r1 - r0) * (c1 - c0))
        out.append(Piece(j, fraction, runs, run * itemsize, (s1 - s0) * itemsize, (c1 - c0) * itemsize))
    return out


def cheap(parts: list[Piece], strided: bool) -> bool:
    """Whether every piece reads directly rather than packed: the planner's own rule on the piece's spans
    (``kvmove.sync.planning.direct.cheap_spans``)."""
    return all(cheap_spans(p.spans(), strided) for p in parts)


def direct_parts(
    shape: tuple[int, ...], itemsize: int, engine: Split, trainer: Split, slices: set[int], strided: bool
) -> dict[int, list[Piece]] | None:
    """Each engine slice's pieces when the planner reads them all directly, None when some piece's runs are too
    many or too short for the transport (the tensor is packed)."""
    out = {}
    for i in slices:
        parts = pieces(shape, itemsize, engine, trainer, i)
        if not cheap(parts, strided):
            return None
        out[i] = parts
    return out
