"""kvmove's own inference engine: vLLM-style fused parameters, loader, and (later) forward passes."""

from kvmove.engines.reference.layers import RankContext
from kvmove.engines.reference.loader import load_weights
from kvmove.engines.reference.model import ReferenceModel, rank_context

__all__ = ["RankContext", "ReferenceModel", "load_weights", "rank_context"]
