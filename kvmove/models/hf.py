"""transformers' side of the model vocabulary: the ``model_type`` of an architecture, and its config warnings
kept quiet."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvmove.errors import ModelError


def model_type_of(architecture: str, model_type: str | None = None) -> str:
    """The transformers ``model_type`` whose causal-LM class is ``architecture`` (ModelError if none is)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    if model_type is not None and names.get(model_type) == architecture:
        return model_type
    candidates = [mt for mt, cls in names.items() if cls == architecture]
    if not candidates:
        raise ModelError(f"architecture {architecture!r} is not a causal LM transformers knows")
    norm = architecture.removesuffix("ForCausalLM").lower()
    candidates.sort(key=lambda mt: (not mt.endswith("_text"), mt.replace("_", "") != norm))
    return candidates[0]


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings about a config (logged, not raised) kept off kvmove's one-line stderr."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
