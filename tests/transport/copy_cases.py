"""Copy plans for executor tests: random mixtures of strided runs and loose spans (mixed widths, odd alignments),
and a pipeline-stage -> tensor-parallel shaped one (row-parallel halves: 1.5 KB rows at a 3 KB pitch)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

SRC_SIZE = 1 << 20
DST_SIZE = 1 << 20


def random_spans(seed: int) -> np.ndarray:
    """Ordered, non-overlapping ``(src, dst, nbytes)`` spans within SRC_SIZE/DST_SIZE: strided runs of aligned
    and odd widths and pitches, loose spans, a few wide spans (wider than the tests' tiles)."""
    rng = np.random.default_rng(seed)
    parts, src, dst = [], int(rng.integers(0, 16)), int(rng.integers(0, 16))
    while True:
        kind = rng.integers(0, 3)
        unit = int(rng.choice([1, 2, 4, 8, 16]))
        if kind == 0:  # a strided run
            rows, width = int(rng.integers(2, 40)), unit * int(rng.integers(1, 64))
            pitch = width + unit * int(rng.integers(0, 8))
        elif kind == 1:  # a loose span
            rows, width, pitch = 1, int(rng.integers(1, 3000)), 0
        else:  # a wide span
            rows, width, pitch = 1, unit * int(rng.integers(1000, 5000)), 0
        if src + rows * max(pitch, width) + 64 > SRC_SIZE or dst + rows * width + 64 > DST_SIZE:
            break
        r = np.arange(rows, dtype=np.int64)
        parts.append(np.stack([src + r * pitch, dst + r * width, np.full(rows, width)], axis=1))
        src += rows * max(pitch, width) + unit * int(rng.integers(0, 4))
        dst += rows * width + unit * int(rng.integers(0, 4))
    return np.concatenate(parts).astype(np.int64)


def stage_to_tp_spans(experts: int = 4, rows: int = 64, row_bytes: int = 3072) -> np.ndarray:
    """An engine tensor-parallel rank's half of each expert's (rows, row_bytes) down projection, then a whole
    expert block as one span: what a pp=2 -> tp=2 read is made of."""
    half = row_bytes // 2
    r = np.arange(experts * rows, dtype=np.int64)
    halves = np.stack([r * row_bytes, r * half, np.full(len(r), half)], axis=1)
    n = experts * rows * row_bytes
    tail = np.array([[n, experts * rows * half, 40960]], dtype=np.int64)
    return np.concatenate([halves, tail])


CASES: dict[str, Callable[[], np.ndarray]] = {
    **{f"random-{seed}": (lambda seed=seed: random_spans(seed)) for seed in range(4)},
    "stage-to-tp": stage_to_tp_spans,
}
