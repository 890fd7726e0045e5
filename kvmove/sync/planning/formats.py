"""Checkpoint formats (a registry): how a trainer names and shapes the tensors it offers, and the conversion of
those tensors to the HF checkpoint that an engine's loader reads.

The conversion is written with view ops only (view, narrow, chunk, select, ...), so the same function converts
real tensors (the broadcast baseline, verification) and, in a recording-tensor dry run, records each HF
tensor as a view chain over the trainer's own tensor: the plan's regions then name trainer tensors, and an
engine region that lies inside a trainer rank's raw shard can be read from it directly, with no gathered HF
copy anywhere. ``hf`` is the identity; ``megatron`` (``kvmove.models.megatron``) is megatron-core's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kvmove.errors import KvmoveError, ModelError
from kvmove.models import megatron
from kvmove.models.config import ModelConfig
from kvmove.models.layout import TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.sync.planning.ownership import Ownership, megatron_rule
from kvmove.sync.planning.plan import SourceTensors

Named = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class CheckpointFormat:
    """One way of naming and shaping a model's tensors (see module docstring).

    ``tensors(cfg, trainer, layers)`` lists the full (unsharded) tensors in the trainer's order (``layers``: only
    those decoder layers, plus the tensors outside layers). ``to_hf(cfg, trainer, named)`` turns them into HF
    tensors with view ops only. ``from_hf(cfg, trainer, hf)`` builds them from a full HF checkpoint (the
    import direction, allowed to copy). ``ownership(cfg, trainer)`` places them on trainer ranks by the
    framework's own rules (a rule-based ``kvmove.sync.planning.ownership.Ownership``).
    """

    name: str
    summary: str
    tensors: Callable[..., list[TensorMeta]]
    to_hf: Callable[[ModelConfig, TrainerLayout, Named], Iterator[tuple[str, torch.Tensor]]]
    from_hf: Callable[[ModelConfig, TrainerLayout, Callable[[str], torch.Tensor], TensorMeta], torch.Tensor]
    ownership: Callable[[ModelConfig, TrainerLayout], Ownership]
    hf: bool = False
    """The HF checkpoint itself: a dry run records the engine's own checkpoint (an FP8 engine's quantized weights
    and scales, which the sync makes from these tensors: kvmove.sync.planning.entries)."""

    def source_tensors(self, cfg: ModelConfig, trainer: TrainerLayout) -> SourceTensors:
        """What a dry run records: this format's tensors, converted to HF by view ops (ModelError for an FP8
        engine fed another format: quantizing is no view op, so its regions cannot name this format's tensors)."""
        if self.hf:
            return SourceTensors.hf(cfg)
        if cfg.engine_dtype != "bf16":
            raise ModelError(
                f"an {cfg.engine_dtype} engine syncs from trainer tensors in the hf format, not {self.name} "
                "(its quantization is no view of the trainer's tensors)"
            )
        return SourceTensors(lambda layers: self.tensors(cfg, trainer, layers), lambda ws: self.to_hf(cfg, trainer, ws))


def _hf_tensors(cfg: ModelConfig, trainer: TrainerLayout, layers: Iterable[int] | None = None) -> list[TensorMeta]:
    return hf_tensors(cfg, layers)


def _identity(cfg: ModelConfig, trainer: TrainerLayout, named: Named) -> Iterator[tuple[str, torch.Tensor]]:
    yield from named


def _hf_from_hf(
    cfg: ModelConfig, trainer: TrainerLayout, hf: Callable[[str], torch.Tensor], meta: TensorMeta
) -> torch.Tensor:
    return hf(meta.name)


def _megatron(grouped: bool) -> CheckpointFormat:
    layout = megatron.MegatronLayout(grouped)
    what = "grouped-GEMM experts (weight0..)" if grouped else "per-local-expert experts (local_experts.E)"
    return CheckpointFormat(
        "megatron" if grouped else "megatron-sequential",
        f"megatron-core names and shapes (TE-fused norms, interleaved QKV, fused gate/up, {what})",
        layout.tensors,
        layout.to_hf,
        layout.from_hf,
        lambda cfg, trainer: Ownership(cfg, trainer, rule=megatron_rule),
    )


FORMATS: dict[str, CheckpointFormat] = {
    f.name: f
    for f in (
        CheckpointFormat(
            "hf", "HF checkpoint names and shapes", _hf_tensors, _identity, _hf_from_hf, Ownership, hf=True
        ),
        _megatron(grouped=True),
        _megatron(grouped=False),
    )
}


def get_format(name: str) -> CheckpointFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise KvmoveError(f"unknown checkpoint format {name!r} (known: {', '.join(FORMATS)})") from None
