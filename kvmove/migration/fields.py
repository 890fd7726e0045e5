"""Constrained field types of the wire messages: what the edge checks before any value reaches the worker.

Every integer that ends up in a tensor, an index or a seed is bounded to its width here, so an oversized value is
a 400 naming the field, never an overflow inside a shared batch step; every string must be encodable as UTF-8 (a
lone surrogate is refused); a temperature must be finite and non-negative.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, Field

INT64_MAX = (1 << 63) - 1

Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A size, index, token id or page id: 0 <= n < 2**63."""

Int64 = Annotated[int, Field(ge=-(1 << 63), le=INT64_MAX)]
"""A signed 64-bit integer (priorities)."""

Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)]
"""A sampling seed: anything ``torch.Generator.manual_seed`` takes (signed or unsigned 64-bit)."""

PositiveCount = Annotated[int, Field(ge=1, le=INT64_MAX)]

SAMPLING_EPS = 1e-6
"""Temperatures below this sample greedily (SGLang's rule), so ``logits / temperature`` never overflows."""


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Temperature = Annotated[float, Field(ge=0.0), AfterValidator(_finite)]
Probability = Annotated[float, Field(gt=0.0, le=1.0)]
Seconds = Annotated[float, Field(gt=0.0), AfterValidator(_finite)]
"""A duration: finite and > 0."""


def check_text(value: Any) -> Any:
    """``value`` unchanged if every string in it (a string, or a list of them) encodes as UTF-8; else ValueError."""
    for s in value if isinstance(value, list) else (value,):
        if isinstance(s, str):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"text cannot be encoded as UTF-8 at character {exc.start} (lone surrogate)") from exc
    return value
