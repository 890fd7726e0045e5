"""A realistic training step to measure delta syncs on: FP32 master weights stepped by AdamW, a BF16 image.

Mixed-precision trainers (Megatron's distributed optimizer, FSDP2 with a BF16 ``param_dtype``) keep FP32 master
weights and hand the engines a BF16 image of them; an element of the image changes only when its master crosses
a BF16 rounding boundary, which at RL learning rates (about 1e-6) few do per step. :class:`SteppedWeights` is that
rule for kvmove's seeded stand-in trainer: each HF tensor's master starts as seeded weights of a realistic size and
takes one ``torch.optim.AdamW`` step per version on seeded noise gradients (the update's size is set by the
learning rate, as Adam's is); the weights of version ``v`` are the image after ``v`` steps. It is deterministic
(same seed, version and device kind: same bits), so an engine rank replays it to verify a sync bit-exact.

:class:`SteppedSource` is the ``SyncConfig.source`` that serves it (Megatron shards of the stepped weights, as
:class:`kvmove.sync.ranks.source.ShardedSource` serves the seeded ones) and the reference engines verify against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvmove.models.config import ModelConfig
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.models.weights import check_verifiable, seeded_tensor


@dataclass(frozen=True)
class AdamwStep:
    """The step rule: AdamW on FP32 masters with seeded Gaussian gradients of ``grad_std``, from masters of
    ``init_std`` (norm weights: 1 plus that), as transformer initializations draw them."""

    lr: float = 1e-6
    init_std: float = 0.02
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_std: float = 1e-2

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learning rate {self.lr} is not positive")


class _Master:
    """One tensor's FP32 master, its optimizer and the version it is at."""

    def __init__(self, meta: TensorMeta, rule: AdamwStep, seed: int, device: str) -> None:
        init = seeded_tensor(meta._replace(dtype=torch.float32), seed, 0, device).mul_(rule.init_std)
        if "norm" in meta.name:
            init.add_(1.0)
        self.param = torch.nn.Parameter(init, requires_grad=False)
        self.opt = torch.optim.AdamW(
            [self.param], lr=rule.lr, betas=rule.betas, eps=rule.eps, weight_decay=rule.weight_decay, foreach=False
        )
        self.version = 0


class SteppedWeights:
    """Per HF tensor, lazily: the master stepped to the version asked for (later versions step on; an earlier one
    starts again from version 0)."""

    def __init__(self, rule: AdamwStep, seed: int, device: str = "cpu") -> None:
        self.rule, self.seed, self.device = rule, seed, device
        self._masters: dict[str, _Master] = {}

    @property
    def nbytes(self) -> int:
        """Memory the masters and AdamW moments take (12 bytes an element)."""
        return sum(12 * m.param.numel() for m in self._masters.values())

    def tensor(self, meta: TensorMeta, version: int) -> torch.Tensor:
        """The weights of ``meta`` at ``version``: the image, in ``meta.dtype``, of the master after that many steps."""
        master = self._masters.get(meta.name)
        if master is None or master.version > version:
            master = self._masters[meta.name] = _Master(meta, self.rule, self.seed, self.device)
        while master.version < version:
            master.version += 1
            self._step(meta, master)
        return master.param.detach().to(meta.dtype)

    def _step(self, meta: TensorMeta, master: _Master) -> None:
        noise = TensorMeta(f"{meta.name}#grad", meta.shape, torch.float32)
        grad = seeded_tensor(noise, self.seed, master.version, self.device)
        master.param.grad = grad.mul_(self.rule.grad_std)
        with torch.no_grad():
            master.opt.step()
        master.param.grad = None


@dataclass(frozen=True)
class SteppedSource:
    """``SourceContext -> WeightSource``: kvmove's seeded Megatron shards, stepped by ``rule`` (see the module
    docstring); ``checkpoint`` is the full reference engines verify against."""

    rule: AdamwStep = field(default_factory=AdamwStep)
    _replay: dict[tuple[int, str], SteppedWeights] = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, ctx: Any) -> Any:
        from kvmove.sync.ranks.collectives import Collectives
        from kvmove.sync.ranks.source import ShardedSource

        coll = Collectives(ctx.rank, ctx.layout.world, ctx.store.host, ctx.store.port, ctx.timeout_s, ctx.device)
        weights = SteppedWeights(self.rule, ctx.seed, ctx.device)
        return ShardedSource(
            ctx.model, ctx.layout, ctx.rank, coll, ctx.seed, ctx.device, ctx.tensor_format, weights=weights.tensor
        )

    def checkpoint(self, cfg: ModelConfig, seed: int, version: int, device: str) -> dict[str, torch.Tensor]:
        """The full HF checkpoint of ``version`` (replayed in this process, stepping on from the last one asked)."""
        check_verifiable(cfg)
        weights = self._replay.get((seed, device))
        if weights is None:
            weights = self._replay[(seed, device)] = SteppedWeights(self.rule, seed, device)
        return {t.name: weights.tensor(t, version) for t in hf_tensors(cfg)}
