"""The comparison of :mod:`kvmove.sync.delta.diff` as two Triton kernels (CUDA): a stream compaction at memory speed.

A step compares a stack of rows of the new payload (a source view) with the same rows of the image, word by word
(int16, or bytes). Where every step of a pull is a stack of rows of contiguous words on both sides (the copies of a
pack program are, once their dimensions are merged: :func:`rows_of`), two kernels find every changed word of the
whole pull, each one launch over a descriptor table of its steps (:func:`table`: one row per step, each program's
step, so a pull of hundreds of tensors costs two launches and one compilation), without a mask in memory:

1. ``count``: one program per chunk of a row counts the words that differ (both views read once);
2. after a prefix sum over the chunks' counts (torch) and one host synchronization (the total, to size the
   output and to go dense past the limit), ``compact``: each chunk with changes reads its words again, ranks its
   changed words by a prefix sum in registers, and writes their payload positions (int64, ascending within a
   step) and new values at its offset, and the new values into the image.

Sources are addressed by their offset from the image's first word (every address is word-aligned), so one kernel
reads views of any number of tensors. Both passes are integer loads and compares, so the result is the torch
path's bit for bit (NaN payloads, -0.0 and +0.0 are words like any other);
``tests/sync/delta/test_triton_diff_interpreter.py`` checks it under Triton's CPU interpreter and the ``gpu``
tests compiled. Imported lazily: kvmove works without triton.
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
    """One step's words as a stack of rows ``(stack, rows, cols)``, contiguous along a row on both sides: where the
    new payload's first word lies (its address) and its stack and row strides, and the image view's first word (a
    payload position) and its strides, all in words. Plain integers: a pull's table is built from hundreds of
    these at its first comparison, and no tensor view is made for them."""

    size: tuple[int, int, int]
    new_ptr: int
    new_strides: tuple[int, int]
    old_at: int
    old_strides: tuple[int, int]


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
    src: torch.Tensor, view: tuple[tuple[int, ...], tuple[int, ...]], slot_at: int, word: torch.dtype
) -> Rows | None:
    """A step (its source ``src``, its slot view's shape/strides ``view`` at element ``slot_at``) as word rows; None
    where source or slot view are not stacks of contiguous rows."""
    shape, stride = view
    found = joint_geometry(shape, src.stride(), stride)
    if found is None:
        return None
    (n, rows, cols), sa, sb = found
    k = src.element_size() // word.itemsize  # words per element
    return Rows((n, rows, cols * k), src.data_ptr(), (sa[0] * k, sa[1] * k), slot_at * k, (sb[0] * k, sb[1] * k))


FIELDS = 10
"""Per step of a table: the new and old views' first words (relative to the image's), rows, cols, chunks per row,
the new and old views' stack and row strides, its first program."""


class Table(NamedTuple):
    """Every step of one pull as one launch: a row of :data:`FIELDS` int64 per step and each program's step."""

    image: torch.Tensor
    """The image as words: every offset is relative to its first word."""
    fields: torch.Tensor
    owner: torch.Tensor
    """Each program's step (int32)."""
    last: torch.Tensor
    """Each step's last program (int64, on the image's device)."""


def table(rows: Sequence[Rows], image: torch.Tensor, word: torch.dtype) -> Table:
    """The descriptor table of ``rows`` (sources anywhere in the device's memory, the image as ``image``, uint8):
    addresses become word offsets from the image's first word (every address is word-aligned)."""
    words = image.view(word)
    base, size = words.data_ptr(), word.itemsize
    fields: list[list[int]] = []
    programs: list[int] = []
    first = 0
    for r in rows:
        n, rs, cols = r.size
        chunks = -(-cols // CHUNK)
        fields.append([(r.new_ptr - base) // size, r.old_at, rs, cols, chunks, *r.new_strides, *r.old_strides, first])
        programs.append(n * rs * chunks)
        first += programs[-1]
    device = image.device
    count = torch.tensor(programs, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), count).to(device)
    last = (torch.cumsum(count, 0) - 1).to(device)
    at = torch.tensor(fields, dtype=torch.int64).view(-1, FIELDS)
    return Table(words, at.to(device), owner, last)


@triton.jit
def _chunk(fields_ptr, owner_ptr, pid, CHUNK: tl.constexpr):
    """Program ``pid``'s chunk: its new and old words' offsets from the image's first word (the old ones are
    payload positions) and which of its columns lie in the row."""
    f = fields_ptr + tl.load(owner_ptr + pid).to(tl.int64) * 10
    new_at, old_at, rows, cols, chunks = tl.load(f), tl.load(f + 1), tl.load(f + 2), tl.load(f + 3), tl.load(f + 4)
    a0, a1, b0, b1, first = tl.load(f + 5), tl.load(f + 6), tl.load(f + 7), tl.load(f + 8), tl.load(f + 9)
    local = pid - first
    row = local // chunks
    stack, row = row // rows, row % rows
    c = (local % chunks) * CHUNK + tl.arange(0, CHUNK)
    return new_at + stack * a0 + row * a1 + c, old_at + stack * b0 + row * b1 + c, c < cols


@triton.jit
def _count_kernel(image_ptr, fields_ptr, owner_ptr, counts_ptr, CHUNK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    new, old, inside = _chunk(fields_ptr, owner_ptr, pid, CHUNK)
    a = tl.load(image_ptr + new, mask=inside, other=0)
    b = tl.load(image_ptr + old, mask=inside, other=0)
    tl.store(counts_ptr + pid, tl.sum((a != b).to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(image_ptr, fields_ptr, owner_ptr, counts_ptr, ends_ptr, pos_ptr, val_ptr, CHUNK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n = tl.load(counts_ptr + pid)
    if n > 0:
        new, old, inside = _chunk(fields_ptr, owner_ptr, pid, CHUNK)
        a = tl.load(image_ptr + new, mask=inside, other=0)
        b = tl.load(image_ptr + old, mask=inside, other=0)
        changed = (a != b) & inside
        k = changed.to(tl.int32)
        out = tl.load(ends_ptr + pid) - n + (tl.cumsum(k, axis=0) - k).to(tl.int64)
        tl.store(pos_ptr + out, old, mask=changed)
        tl.store(val_ptr + out, a, mask=changed)
        tl.store(image_ptr + old, a, mask=changed)


def count(t: Table) -> torch.Tensor:
    """The changed words of each program's chunk (int32, on the image's device)."""
    counts = torch.empty(len(t.owner), dtype=torch.int32, device=t.image.device)
    if len(t.owner):
        _count_kernel[(len(t.owner),)](t.image, t.fields, t.owner, counts, CHUNK=CHUNK)
    return counts


class Compacted(NamedTuple):
    """The changed words of every step, in step order: payload positions (int64) and new values."""

    positions: torch.Tensor
    values: torch.Tensor


def compact(t: Table, counts: torch.Tensor, ends: torch.Tensor, total: int) -> Compacted:
    """The ``total`` changed words (``counts``: :func:`count`'s, ``ends`` their inclusive prefix sum, int64), the
    image taking the new ones."""
    positions = torch.empty(total, dtype=torch.int64, device=t.image.device)
    values = torch.empty(total, dtype=t.image.dtype, device=t.image.device)
    if total:
        _compact_kernel[(len(t.owner),)](t.image, t.fields, t.owner, counts, ends, positions, values, CHUNK=CHUNK)
    return Compacted(positions, values)


def warm(device: torch.device | str) -> None:
    """Compile both kernels for every word type (tables hold every size, so one compilation serves any pull)."""
    for word in (torch.int16, torch.uint8):
        image = torch.zeros(2 * CHUNK * word.itemsize, dtype=torch.uint8, device=device)
        new = torch.ones(CHUNK, dtype=word, device=device)
        t = table([Rows((1, 1, CHUNK), new.data_ptr(), (CHUNK, CHUNK), 0, (CHUNK, CHUNK))], image, word)
        counts = count(t)
        compact(t, counts, torch.cumsum(counts, 0, dtype=torch.int64), CHUNK)
