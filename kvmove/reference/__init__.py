"""kvmove's own inference engine: vLLM-style fused parameters, loader, paged forward pass and rollout worker.

Pipeline: ``request`` -> ``scheduler`` (priorities, KV budget) -> ``kv_manager`` (page ownership, radix cache)
-> ``runner`` (batch -> ``forward``) -> ``worker`` (submit / step / abort, migration hooks, stats).
"""

from kvmove.reference.kv_manager import ExportedKV, ImportResult
from kvmove.reference.layers import RankContext
from kvmove.reference.loader import load_weights
from kvmove.reference.model import ReferenceModel, rank_context
from kvmove.reference.request import (
    FinishReason,
    Request,
    RequestError,
    RequestFailedError,
    RequestState,
    SamplingParams,
    UnknownRequestError,
)
from kvmove.reference.worker import (
    RolloutWorker,
    StepOutput,
    WorkerConfig,
    WorkerStats,
    build_model,
    build_models,
    rank_geometry,
)

__all__ = [
    "ExportedKV",
    "FinishReason",
    "ImportResult",
    "RankContext",
    "ReferenceModel",
    "Request",
    "RequestError",
    "RequestFailedError",
    "RequestState",
    "RolloutWorker",
    "SamplingParams",
    "StepOutput",
    "UnknownRequestError",
    "WorkerConfig",
    "WorkerStats",
    "build_model",
    "build_models",
    "load_weights",
    "rank_context",
    "rank_geometry",
]
