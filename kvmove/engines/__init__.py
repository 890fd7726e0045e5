"""Inference engines kvmove syncs into, behind one adapter interface, in a registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.layout import EngineCoord, EngineLayout
from kvmove.models.checkpoint import engine_checkpoint
from kvmove.models.config import ModelConfig


@dataclass(frozen=True)
class EngineAdapter:
    """How kvmove builds one engine rank's model and runs that engine's own weight loader.

    ``build`` must create the parameters of rank ``coord`` holding only ``layers`` (None: all of its stage)
    on ``device`` ("meta" for dry runs: no memory). ``load_weights`` must be the engine's real loader.
    """

    name: str
    build: Callable[..., nn.Module]
    load_weights: Callable[[nn.Module, Iterable[tuple[str, torch.Tensor]]], object]


def _reference_build(
    cfg: ModelConfig,
    layout: EngineLayout,
    coord: EngineCoord,
    *,
    layers: Sequence[int] | None = None,
    device: str = "cpu",
) -> nn.Module:
    from kvmove.engines.reference import ReferenceModel, rank_context

    return ReferenceModel(cfg, rank_context(cfg, layout, coord, layers=layers, device=device))


def _reference_load(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
    from kvmove.engines.reference import load_weights

    return load_weights(model, weights)  # type: ignore[arg-type]


def _vllm_build(*_args: object, **_kwargs: object) -> nn.Module:
    raise KvmoveError(
        "vLLM plans are recorded inside a running vLLM engine (its own loader on its unprocessed model): "
        "run `kvmove sync-weights --engine-kind vllm` without --dry-run"
    )


ENGINES: dict[str, EngineAdapter] = {
    "reference": EngineAdapter("reference", _reference_build, _reference_load),
    "vllm": EngineAdapter("vllm", _vllm_build, lambda model, weights: model.load_weights(weights)),  # type: ignore[operator]
}


def get_engine(name: str) -> EngineAdapter:
    try:
        return ENGINES[name]
    except KeyError:
        raise KvmoveError(f"unknown engine kind {name!r} (known: {', '.join(ENGINES)})") from None


def reference_models(
    engine: EngineAdapter, cfg: ModelConfig, layout: EngineLayout, weights: Mapping[str, torch.Tensor]
) -> list[nn.Module]:
    """Every rank of one replica as the engine's own loader fills it from the full BF16 checkpoint ``weights``.

    The checkpoint is first put in the engine's format once (kvmove.models.checkpoint.engine_checkpoint: for an
    FP8 engine, every quantized tensor quantized whole by the engine's quantizer): what synced ranks must equal.
    """
    checkpoint = engine_checkpoint(cfg, weights)
    models = []
    for rank in range(layout.ranks_per_replica):
        model = engine.build(cfg, layout, layout.coord(rank))
        engine.load_weights(model, checkpoint.items())
        models.append(model)
    return models
