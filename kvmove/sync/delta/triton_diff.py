"""The comparison of :mod:`kvmove.sync.delta.diff` as two Triton kernels (CUDA): a stream compaction at memory speed.

A step compares a stack of rows of the new payload (a source view) with the same rows of the image, word by word
(int16, or bytes). Where both views are stacks of rows of contiguous words (the copies of a pack program are, once
their dimensions are merged: :func:`rows_of`), two passes find every changed word without a mask in memory:

1. ``count``: one program per chunk of a row counts the words that differ (both views read once);
2. after an exclusive prefix sum over the chunks' counts (torch), ``compact``: each chunk with changes reads its
   words again, ranks its changed words by a prefix sum in registers, and writes their payload positions
   (int64, ascending) and new values at its offset, and the new values into the image.

Both passes are integer loads and compares, so the result is the torch path's bit for bit (NaN payloads, -0.0
and +0.0 are words like any other); ``tests/sync/delta/test_triton_diff_interpreter.py`` checks it under Triton's
CPU interpreter and the ``gpu`` tests compiled. Imported lazily: kvmove works without triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

CHUNK = 4096
"""Words per program: a 8 KiB (int16) run of a row, two of them in flight per program."""


class Rows(NamedTuple):
    """One step's words as a stack of rows: the new payload's and the image's views, ``(stack, rows, cols)`` with
    contiguous rows, and the payload position of the image view's first word."""

    new: torch.Tensor
    old: torch.Tensor
    at: int


def joint_geometry(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
    """``((stack, rows, cols), a_strides, b_strides)`` where two views of ``shape`` with strides ``a`` and ``b``
    are both stacks of rows of contiguous elements (size-1 dimensions dropped, dimensions that are one run in
    both merged); None where they are not."""
    dims: list[tuple[int, int, int]] = []  # (size, stride in a, stride in b)
    for n, sa, sb in zip(shape, a, b, strict=True):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * sa and dims[-1][2] == n * sb:
            dims[-1] = (dims[-1][0] * n, sa, sb)
        else:
            dims.append((n, sa, sb))
    if (dims and (dims[-1][1] != 1 or dims[-1][2] != 1)) or len(dims) > 3:
        return None
    dims = [(1, 0, 0)] * (3 - len(dims)) + dims if dims else [(1, 0, 0), (1, 0, 0), (1, 1, 1)]
    return tuple(d[0] for d in dims), tuple(d[1] for d in dims), tuple(d[2] for d in dims)


def rows_of(
    src: torch.Tensor,
    view: tuple[tuple[int, ...], tuple[int, ...]],
    slot_at: int,
    image: torch.Tensor,
    word: torch.dtype,
) -> Rows | None:
    """A step (its source ``src``, its slot view's shape/strides ``view`` at element ``slot_at``) as word rows on
    ``image`` (uint8, laid out as the slot); None where source or slot view are not stacks of contiguous rows."""
    shape, stride = view
    found = joint_geometry(shape, src.stride(), stride)
    if found is None:
        return None
    (n, rows, cols), sa, sb = found
    k = src.element_size() // word.itemsize  # words per element
    size = (n, rows, cols * k)
    storage = src.untyped_storage()
    flat = torch.empty(0, dtype=word, device=src.device).set_(storage, 0, (storage.nbytes() // word.itemsize,), (1,))
    new = flat.as_strided(size, (sa[0] * k, sa[1] * k, 1), src.storage_offset() * k)
    old = image.view(word).as_strided(size, (sb[0] * k, sb[1] * k, 1), slot_at * k)
    return Rows(new, old, slot_at * k)


@triton.jit
def _row_offsets(pid, chunks, rows, s0, s1, CHUNK: tl.constexpr):
    """The first element of program ``pid``'s row in a view of strides ``s0``, ``s1``, and its chunk's columns."""
    row = pid // chunks
    base = (row // rows).to(tl.int64) * s0 + (row % rows).to(tl.int64) * s1
    return base, (pid % chunks) * CHUNK + tl.arange(0, CHUNK)


@triton.jit
def _count_kernel(new_ptr, old_ptr, counts_ptr, rows, cols, chunks, a0, a1, b0, b1, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    a_at, c = _row_offsets(pid, chunks, rows, a0, a1, CHUNK)
    b_at, _ = _row_offsets(pid, chunks, rows, b0, b1, CHUNK)
    inside = c < cols
    a = tl.load(new_ptr + a_at + c, mask=inside, other=0)
    b = tl.load(old_ptr + b_at + c, mask=inside, other=0)
    tl.store(counts_ptr + pid, tl.sum((a != b).to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(
    new_ptr, old_ptr, counts_ptr, starts_ptr, pos_ptr, val_ptr, rows, cols, chunks, a0, a1, b0, b1, at,
    CHUNK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if tl.load(counts_ptr + pid) > 0:
        a_at, c = _row_offsets(pid, chunks, rows, a0, a1, CHUNK)
        b_at, _ = _row_offsets(pid, chunks, rows, b0, b1, CHUNK)
        inside = c < cols
        a = tl.load(new_ptr + a_at + c, mask=inside, other=0)
        b = tl.load(old_ptr + b_at + c, mask=inside, other=0)
        changed = (a != b) & inside
        k = changed.to(tl.int32)
        out = tl.load(starts_ptr + pid) + (tl.cumsum(k, axis=0) - k).to(tl.int64)
        tl.store(pos_ptr + out, at + b_at + c.to(tl.int64), mask=changed)
        tl.store(val_ptr + out, a, mask=changed)
        tl.store(old_ptr + b_at + c, a, mask=changed)


def _launch(rows: Rows) -> tuple[int, tuple[int, ...]]:
    """Programs of a pass over ``rows`` and the kernels' geometry arguments."""
    n, r, cols = rows.new.shape
    chunks = triton.cdiv(cols, CHUNK)
    (a0, a1, _), (b0, b1, _) = rows.new.stride(), rows.old.stride()
    return n * r * chunks, (r, cols, chunks, a0, a1, b0, b1)


def count(rows: Rows) -> torch.Tensor:
    """The changed words of each chunk of ``rows`` (int32, one per program, on the views' device)."""
    programs, geometry = _launch(rows)
    counts = torch.empty(programs, dtype=torch.int32, device=rows.new.device)
    if programs:
        _count_kernel[(programs,)](rows.new, rows.old, counts, *geometry, CHUNK=CHUNK)
    return counts


class Compacted(NamedTuple):
    """The changed words of a step: payload positions (int64, ascending) and new values."""

    positions: torch.Tensor
    values: torch.Tensor


def compact(rows: Rows, counts: torch.Tensor, total: int) -> Compacted:
    """The ``total`` changed words of ``rows`` (``counts``: :func:`count`'s), the image view taking the new ones."""
    device = rows.new.device
    positions = torch.empty(total, dtype=torch.int64, device=device)
    values = torch.empty(total, dtype=rows.new.dtype, device=device)
    if total:
        programs, geometry = _launch(rows)
        wide = counts.to(torch.int64)
        starts = torch.cumsum(wide, 0) - wide
        _compact_kernel[(programs,)](
            rows.new, rows.old, counts, starts, positions, values, *geometry, rows.at, CHUNK=CHUNK
        )
    return Compacted(positions, values)
