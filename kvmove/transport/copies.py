"""Copy plans (pure planning): byte spans folded into 2-D copies, so a strided region costs one copy, not one per row.

A direct pull reads ``(src byte, dst byte, nbytes)`` spans (``kvmove.sync.planning.direct.byte_spans``). A region
that is a column block of a row-major matrix (a row-parallel split, a pipeline stage's share of a matrix the
engine splits the other way) is one span per row: thousands of launches for a copy the hardware does in one.
:func:`plan_copies` finds the runs of spans of one width whose source and destination advance by a constant
pitch and turns each into one ``(src, dst, width, height, src_pitch, dst_pitch)`` copy, the shape
``cudaMemcpy2DAsync`` takes. Executors move the bytes: :func:`copy_views` here (torch strided views, any device;
the CPU path CI runs), and the CUDA driver's 2-D copies in ``kvmove.transport.cuda_driver``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

SRC, DST, WIDTH, HEIGHT, SRC_PITCH, DST_PITCH = range(6)
MAX_HEIGHT = 65535
"""Rows per 2-D copy (longer runs are split): the line count a DMA engine takes in one descriptor."""
MAX_PITCH = (1 << 31) - 1
"""Largest pitch a 2-D copy takes (CUDA's ``CU_DEVICE_ATTRIBUTE_MAX_PITCH`` on current GPUs); wider runs stay 1-D."""


class CopyPlan(NamedTuple):
    """``copies``: ``(m, 6)`` int64 rows ``(src, dst, width, height, src_pitch, dst_pitch)`` in bytes; a row of
    height 1 is a plain 1-D copy (its pitches equal its width)."""

    copies: np.ndarray

    @property
    def ncopies(self) -> int:
        return len(self.copies)

    @property
    def nbytes(self) -> int:
        return int((self.copies[:, WIDTH] * self.copies[:, HEIGHT]).sum())

    @property
    def strided(self) -> np.ndarray:
        """The rows that are 2-D copies (height > 1)."""
        return self.copies[self.copies[:, HEIGHT] > 1]

    def smallest(self) -> int:
        """Bytes of the smallest copy (0 for an empty plan)."""
        return int((self.copies[:, WIDTH] * self.copies[:, HEIGHT]).min()) if self.ncopies else 0


def plan_copies(spans: np.ndarray, min_height: int = 2) -> CopyPlan:
    """Fold ``(n, 3)`` spans (in order) into 2-D copies wherever at least ``min_height`` consecutive spans share a
    width and advance by one constant source pitch and one constant destination pitch (each at least the width:
    rows never overlap). Everything else stays a 1-D copy; the copies move exactly the spans' bytes."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
    n = len(spans)
    out: list[np.ndarray] = []
    start = 0
    for a, b in _runs(spans):  # span ranges [a, b) that form one pattern, in order, disjoint
        if start < a:
            out.append(_flat(spans[start:a]))
        if b - a >= min_height:
            out.append(_folded(spans, a, b))
        else:
            out.append(_flat(spans[a:b]))
        start = b
    if start < n:
        out.append(_flat(spans[start:]))
    copies = np.concatenate(out) if out else np.zeros((0, 6), dtype=np.int64)
    return CopyPlan(copies)


def _runs(spans: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of spans linked by one constant (source step, destination step, width), greedy from the left.

    A *link* joins span i-1 to span i when both have the same width and both steps are at least that width and at
    most MAX_PITCH. Consecutive links with equal steps form a segment; a span shared by two segments goes to the
    first, so the second starts one span later.
    """
    if len(spans) < 2:
        return []
    ds, dd = np.diff(spans[:, 0]), np.diff(spans[:, 1])
    w = spans[1:, 2]
    ok = (spans[:-1, 2] == w) & (ds >= w) & (dd >= w) & (ds <= MAX_PITCH) & (dd <= MAX_PITCH)
    links = np.flatnonzero(ok) + 1  # link i joins spans i-1 and i
    if not len(links):
        return []
    steps = np.stack([ds[links - 1], dd[links - 1], w[links - 1]], axis=1)
    new = np.ones(len(links), dtype=bool)
    new[1:] = (np.diff(links) != 1) | (steps[1:] != steps[:-1]).any(axis=1)
    bounds = np.flatnonzero(new)
    runs: list[tuple[int, int]] = []
    taken = 0  # first span not yet in a run
    for j, first in enumerate(bounds):
        last = bounds[j + 1] - 1 if j + 1 < len(bounds) else len(links) - 1
        a, b = int(links[first]) - 1, int(links[last]) + 1  # spans [a, b)
        a = max(a, taken)
        if b - a >= 2:
            runs.append((a, b))
            taken = b
    return runs


def _flat(spans: np.ndarray) -> np.ndarray:
    out = np.empty((len(spans), 6), dtype=np.int64)
    out[:, SRC], out[:, DST], out[:, WIDTH] = spans[:, 0], spans[:, 1], spans[:, 2]
    out[:, HEIGHT] = 1
    out[:, SRC_PITCH], out[:, DST_PITCH] = spans[:, 2], spans[:, 2]
    return out


def _folded(spans: np.ndarray, a: int, b: int) -> np.ndarray:
    """The run of spans [a, b) as 2-D copies of at most MAX_HEIGHT rows each."""
    sp, dp = int(spans[a + 1, 0] - spans[a, 0]), int(spans[a + 1, 1] - spans[a, 1])
    starts = np.arange(a, b, MAX_HEIGHT)
    out = np.empty((len(starts), 6), dtype=np.int64)
    out[:, SRC], out[:, DST] = spans[starts, 0], spans[starts, 1]
    out[:, WIDTH] = spans[a, 2]
    out[:, HEIGHT] = np.minimum(MAX_HEIGHT, b - starts)
    out[:, SRC_PITCH], out[:, DST_PITCH] = sp, dp
    return out


def shifted(plan: CopyPlan, src: int, dst: int) -> CopyPlan:
    """``plan`` with every source offset moved by ``src`` bytes and every destination offset by ``dst`` (e.g. to
    one base address shared by the reads of a batch)."""
    copies = plan.copies.copy()
    copies[:, SRC] += src
    copies[:, DST] += dst
    return CopyPlan(copies)


def expand(plan: CopyPlan) -> np.ndarray:
    """The ``(n, 3)`` spans a plan moves, one per row (the inverse of :func:`plan_copies`, for checks and for
    executors that only copy 1-D)."""
    c = plan.copies
    if not len(c):
        return np.zeros((0, 3), dtype=np.int64)
    rows = np.repeat(np.arange(len(c)), c[:, HEIGHT])
    within = np.arange(len(rows)) - np.repeat(np.cumsum(c[:, HEIGHT]) - c[:, HEIGHT], c[:, HEIGHT])
    out = np.empty((len(rows), 3), dtype=np.int64)
    out[:, 0] = c[rows, SRC] + within * c[rows, SRC_PITCH]
    out[:, 1] = c[rows, DST] + within * c[rows, DST_PITCH]
    out[:, 2] = c[rows, WIDTH]
    return out


def copy_views(src: torch.Tensor, dst: torch.Tensor, plan: CopyPlan) -> None:
    """Execute ``plan`` from flat uint8 ``src`` into flat uint8 ``dst`` with torch: one strided-view copy per row
    (a 2-D copy is one ``copy_`` of two ``as_strided`` views). Any devices; on CUDA it is asynchronous on the
    current stream."""
    s0, d0 = src.storage_offset(), dst.storage_offset()
    for s, d, w, h, sp, dp in plan.copies.tolist():
        if h == 1:
            dst[d : d + w].copy_(src[s : s + w], non_blocking=True)
        else:
            into = dst.as_strided((h, w), (dp, 1), d0 + d)
            into.copy_(src.as_strided((h, w), (sp, 1), s0 + s), non_blocking=True)
