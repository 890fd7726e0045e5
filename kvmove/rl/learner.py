"""The trainer ranks of the RL loop: an FSDP2 transformers policy (``kvmove.sync.sources.tiny_trainer``'s model
and sharding), one REINFORCE step per batch of rollouts, a ``save_pretrained`` checkpoint per synced step.

:class:`RlTrainer` is the ``SourceContext -> FsdpSource`` factory (``SyncConfig.source``) built in each trainer
rank's process: the driver hands every rank the step's rollouts (``TrainStep``), each rank trains on its share
(FSDP2 averages the gradients over the data-parallel ranks), and ``step(version)`` saves the weights the sync then
moves, which the engines are verified against.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvmove.errors import KvmoveError
from kvmove.models.table import hf_tensors
from kvmove.rl.rollouts import Rollouts
from kvmove.sync.ranks.source import SourceContext
from kvmove.sync.sources.fsdp import FsdpSource
from kvmove.sync.sources.tiny_trainer import hf_model, init_group, save_checkpoint, shard


class TrainReport(NamedTuple):
    """One trainer rank's training step."""

    rank: int
    loss: float
    samples: int
    tokens: int
    logprob_gap: float
    """Mean |trainer log-prob - engine log-prob| of the sampled tokens, before the step: how far the engine's
    numerics are from the trainer's on the same (synced) weights."""


@dataclass(frozen=True)
class RlTrainer:
    """``SourceContext -> FsdpSource`` of the RL loop's policy (see module docstring)."""

    save_dir: str
    """``step(version)`` saves ``save_dir/step-{version}`` (what each sync is verified against)."""
    lr: float = 1e-3
    master: bool = False
    """FP32 master parameters (FSDP2 mixed precision: BF16 compute), a BF16 image synced and saved."""

    def __call__(self, ctx: SourceContext) -> FsdpSource:
        group = init_group(ctx)
        model = hf_model(ctx.model, ctx.seed, ctx.device)
        if self.master:
            model = model.float()
        shard(model, ctx.layout.world, ctx.device, master=self.master)
        learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=self.lr), ctx)
        image = torch.bfloat16 if self.master else None
        save = partial(_save, model, Path(self.save_dir), ctx.rank, image)
        order = [t.name for t in hf_tensors(ctx.model)]
        return FsdpSource(model, group, order, on_step=save, on_train=learner, image_dtype=image)


def _save(model: torch.nn.Module, save_dir: Path, rank: int, image: torch.dtype | None, version: int) -> None:
    save_checkpoint(model, save_dir / f"step-{version}", rank, image)


class Learner:
    """REINFORCE on this rank's share of the rollouts: loss = -mean over completion tokens of advantage x
    log-probability of the sampled token."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, ctx: SourceContext) -> None:
        self.model, self.optimizer, self.ctx = model, optimizer, ctx

    def __call__(self, batch: Any) -> TrainReport:
        if not isinstance(batch, Rollouts):
            raise KvmoveError(f"the RL trainer trains on Rollouts, not {type(batch).__name__}")
        share = batch.share(self.ctx.rank, self.ctx.layout.world)
        ids, mask, start = _pack(share, self.ctx.device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        taken = _completion_mask(share, ids.shape[1] - 1, start).to(logp.device)
        adv = torch.tensor([s.advantage for s in share.samples], device=logp.device)[:, None]
        loss = -(adv * logp * taken).sum() / taken.sum().clamp(min=1)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        gap = _logprob_gap(share, logp.detach(), start)
        return TrainReport(self.ctx.rank, float(loss.detach()), len(share.samples), int(taken.sum()), gap)


class Packed(NamedTuple):
    """Prompt + completion token ids, right-padded; the attention mask; where each completion starts."""

    ids: torch.Tensor
    mask: torch.Tensor
    start: list[int]


def _pack(share: Rollouts, device: str) -> Packed:
    """Prompt + completion token ids, right-padded; the attention mask; where each completion starts."""
    seqs = [list(s.prompt) + list(s.tokens) for s in share.samples]
    width = max(len(q) for q in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, q in enumerate(seqs):
        ids[i, : len(q)] = torch.tensor(q)
        mask[i, : len(q)] = 1
    return Packed(ids.to(device), mask.to(device), [len(s.prompt) for s in share.samples])


def _completion_mask(share: Rollouts, width: int, start: list[int]) -> torch.Tensor:
    """1 where position j predicts a sampled token (token j + 1 is part of the completion)."""
    mask = torch.zeros(len(share.samples), width)
    for i, (s, p) in enumerate(zip(share.samples, start, strict=True)):
        mask[i, p - 1 : p - 1 + len(s.tokens)] = 1
    return mask


def _logprob_gap(share: Rollouts, logp: torch.Tensor, start: list[int]) -> float:
    gaps = [
        abs(float(logp[i, p - 1 + j]) - e)
        for i, (s, p) in enumerate(zip(share.samples, start, strict=True))
        for j, e in enumerate(s.engine_logprobs)
    ]
    return sum(gaps) / max(1, len(gaps))
