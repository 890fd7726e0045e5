"""The trainer's comparison of a pull's new payload with the image it last served, read straight from the sources.

A packed pull is packed by a program of batched copies (``kvmove.sync.programs``), each from a source view into
a stack of whole parts of the serve slot. The image a trainer rank keeps of a pull is laid out as the slot, so
each copy's slot view, placed on the image instead, is where the image holds what that copy would write.
:func:`diff` compares each copy's source with that view as integers of the copy's element size (the program
already moves elements as the widest integer words the views allow, ``kvmove.sync.programs.as_words``: mostly
int64), so the payload is never packed densely:

1. ``ne`` over the source and the image view, and the changed elements counted;
2. if they hold no more words than an encoding carries in fewer bytes than dense (``limit``; where they could,
   the changed words are counted by one more streaming pass), ``nonzero``: the elements that changed;
3. their new values gathered from the source's storage and their old ones from the image, and only those
   elements written into the image (``index_select``, ``index_copy_``);
4. each changed element split into its words (int16, or bytes): the changed words, their positions in the
   payload and their values.

That is two reads of the pull's bytes and work proportional to the changes, where a dense pack reads and
writes every byte. Where too many words changed, nothing is gathered: the pull goes dense (the caller packs it
and refreshes the image from the slot).

Where the program quantizes (FP8 computed on the trainer) there is no source of the payload's bytes to compare:
the payload is packed into the slot first and the slot is compared instead (:func:`slot_steps`); the alignment
padding between its parts, which the pack leaves as it was, is dropped from the result.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvmove.sync.delta.encoding import Words
from kvmove.sync.programs import Program

if TYPE_CHECKING:
    from kvmove.sync.delta.triton_diff import Rows

INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
"""The integer type of each element size: elements are compared as bits."""

Geometry = tuple[tuple[int, ...], tuple[int, ...]]


class Flat(NamedTuple):
    """A strided view as offsets into its whole storage: the storage as one flat tensor, the view's first
    element and its merged geometry."""

    storage: torch.Tensor
    at: int
    geometry: Geometry

    @classmethod
    def of(cls, t: torch.Tensor) -> Flat:
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.itemsize,), (1,))
        return cls(flat, int(t.storage_offset()), merged(t.shape, t.stride()))

    def offsets(self, index: torch.Tensor) -> torch.Tensor:
        """Row-major element indices of the view -> offsets in the storage."""
        return offsets(index, *self.geometry) + self.at


class Step(NamedTuple):
    """One batched copy of a pack program, as integers: the source of the new payload, and the slot view it
    packs into (the same on the image) - a stack of whole parts."""

    src: torch.Tensor
    source: Flat
    view: Geometry
    """The slot view's shape and strides (the source's shape)."""
    slot: Flat
    """The slot view's offsets, from the start of the slot (in elements)."""
    ratio: int
    """Words per element."""
    blocks: tuple[int, ...]
    """The first word of each stacked part (ascending)."""

    def on(self, image: torch.Tensor) -> torch.Tensor:
        """The step's slot view placed on ``image`` (uint8, laid out as the slot)."""
        return image.view(self.src.dtype).as_strided(*self.view, self.slot.at)

    @property
    def end(self) -> int:
        """The word past the step's last."""
        shape, stride = self.slot.geometry
        return (self.slot.at + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * self.ratio


class Steps(NamedTuple):
    """The steps of one pull, and the order of their parts in the payload where they interleave (None: the
    steps' words, concatenated, are in ascending positions)."""

    steps: tuple[Step, ...]
    order: tuple[tuple[int, int], ...] | None
    """(step, stacked part) in payload order."""
    packed: bool
    """The steps read the packed slot (:func:`slot_steps`): run the pack first, drop padding from the result."""


class Changes(NamedTuple):
    """The words of a pull that changed: positions in the payload (int64, ascending) and new values."""

    positions: torch.Tensor
    values: torch.Tensor


def merged(shape: Sequence[int], stride: Sequence[int]) -> Geometry:
    """``shape``/``stride`` with size-1 dimensions dropped and dimensions that are one run merged."""
    out: list[tuple[int, int]] = []
    for n, s in zip(shape, stride, strict=True):
        if n == 1:
            continue
        if out and out[-1][1] == n * s:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    if not out:
        return (1,), (1,)
    return tuple(n for n, _ in out), tuple(s for _, s in out)


def offsets(index: torch.Tensor, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """Row-major element indices of a view of (merged) ``shape``/``stride`` -> element offsets from its first."""
    if len(shape) == 1:
        return index * stride[0] if stride[0] != 1 else index
    if len(shape) == 2 and stride[1] == 1:  # rows with gaps between them (a stack of parts, a slice of columns)
        return index + torch.div(index, shape[1], rounding_mode="floor") * (stride[0] - shape[1])
    out, rest = torch.zeros_like(index), index
    for n, s in zip(reversed(shape[1:]), reversed(stride[1:]), strict=True):
        out += (rest % n) * s
        rest = torch.div(rest, n, rounding_mode="floor")
    return out + rest * stride[0]


def program_steps(program: Program, buf: torch.Tensor, words: Words) -> Steps | None:
    """The copies of ``program`` (packing into ``buf``) as steps; None where it quantizes, converts, copies
    elements narrower than a word or into views that are not stacks of whole parts (then compare the packed
    slot: :func:`slot_steps`)."""
    if program.quantize:
        return None
    steps = []
    for c in program.copies:
        if c.src.dtype != c.dst.dtype:  # a copy that converts: its bytes exist only once packed
            return None
        size = c.dst.element_size()
        rel = c.dst.data_ptr() - buf.data_ptr()
        dst, src = c.dst.view(INTS[size]), c.src.view(INTS[size])
        geometry = merged(dst.shape, dst.stride())
        if size % words.word_bytes or rel % size or len(geometry[0]) > 2 or geometry[1][-1] != 1:
            return None
        ratio, at = size // words.word_bytes, rel // size
        blocks = tuple((at + i * dst.stride(0)) * ratio for i in range(dst.shape[0])) if dst.dim() else (at,)
        slot = Flat(buf, at, geometry)
        steps.append(Step(src, Flat.of(src), (tuple(dst.shape), tuple(dst.stride())), slot, ratio, blocks))
    steps.sort(key=lambda s: s.blocks[0])
    if all(a.end <= b.blocks[0] for a, b in itertools.pairwise(steps)):
        return Steps(tuple(steps), None, packed=False)
    order = sorted((b, s, i) for s, step in enumerate(steps) for i, b in enumerate(step.blocks))
    return Steps(tuple(steps), tuple((s, i) for _, s, i in order), packed=False)


def slot_steps(buf: torch.Tensor, words: Words) -> Steps:
    """The packed payload in ``buf`` as one step of the widest integers its size and address allow."""
    n = words.dense_bytes
    size = next(s for s in (8, 4, 2, 1) if n % s == 0 and buf.data_ptr() % s == 0 and s >= words.word_bytes)
    src = buf[:n].view(INTS[size])
    line = ((src.numel(),), (1,))
    step = Step(src, Flat.of(src), line, Flat(buf, 0, line), size // words.word_bytes, (0,))
    return Steps((step,), None, packed=True)


def diff(steps: Steps, image: torch.Tensor, words: Words, limit: int, backend: str | None = None) -> Changes | None:
    """The words of the new payload (read by ``steps``) that differ from ``image`` (uint8, laid out as the
    slot), which then takes the new payload's values. None, the image left as it was, where more than ``limit``
    words changed (no encoding would be smaller than dense).

    ``backend``: ``torch`` (any device) or ``triton`` (:mod:`kvmove.sync.delta.triton_diff`, where every step is
    rows of contiguous words); by default Triton for CUDA tensors where it is installed and applies."""
    rows = _rows(steps, image, words) if (backend or _default_backend(steps)) == "triton" else None
    if rows is not None:
        return _diff_rows(steps, rows, image, words, limit)
    masks = [torch.ne(step.src, step.on(image)).view(-1) for step in steps.steps]
    elements = [int(torch.count_nonzero(m)) for m in masks]
    if sum(elements) > limit:  # each changed element holds at least one changed word
        return None
    most = sum(n * step.ratio for n, step in zip(elements, steps.steps, strict=True))
    if most > limit and _words(steps, image) > limit:
        return None
    found = [
        _changed(step, image.view(step.src.dtype), m.nonzero().flatten(), words)
        for step, m in zip(steps.steps, masks, strict=True)
    ]
    changes = _concat(found) if steps.order is None else _in_order(steps, found)
    return _live(changes, words) if steps.packed else changes


def _default_backend(steps: Steps) -> str:
    from kvmove.quant.quantizer import triton_available

    return "triton" if steps.steps and steps.steps[0].src.is_cuda and triton_available() else "torch"


def _rows(steps: Steps, image: torch.Tensor, words: Words) -> list[Rows] | None:
    """Every step as word rows on ``image`` (None where one is not rows of contiguous words: compare with torch)."""
    from kvmove.sync.delta.triton_diff import rows_of

    rows = [rows_of(s.src, s.view, s.slot.at, image, words.dtype) for s in steps.steps]
    return None if any(r is None for r in rows) else [r for r in rows if r is not None]


def _diff_rows(steps: Steps, rows: Sequence[Rows], image: torch.Tensor, words: Words, limit: int) -> Changes | None:
    """:func:`diff` by the Triton compaction: two launches for every step of the pull and one host synchronization
    (each step's count)."""
    from kvmove.sync.delta.triton_diff import compact, count, table

    t = table(rows, image, words.dtype)
    counts = count(t)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    bounds = [0, *ends.index_select(0, torch.tensor(t.ends, device=ends.device) - 1).tolist()]
    if bounds[-1] > limit:
        return None
    every = Changes(*compact(t, counts, ends, bounds[-1]))  # in step order
    if steps.order is None:
        changes = every
    else:
        changes = _in_order(steps, [Changes(*(x[a:b] for x in every)) for a, b in itertools.pairwise(bounds)])
    return _live(changes, words) if steps.packed else changes


def _words(steps: Steps, image: torch.Tensor) -> int:
    """How many words of the new payload differ from ``image``, by one more streaming pass: for when the changed
    elements could hold too many changed words between them (near dense, where gathering them all to find out
    would cost more than packing)."""
    total = 0
    for step in steps.steps:
        w = INTS[step.src.element_size() // step.ratio]
        total += int(torch.count_nonzero(torch.ne(step.src.view(w), step.on(image).view(w))))
    return total


def _changed(step: Step, image: torch.Tensor, index: torch.Tensor, words: Words) -> Changes:
    """The changed words among the changed elements ``index`` of ``step`` (written into ``image``, flat)."""
    at = step.slot.offsets(index)
    new = step.source.storage.index_select(0, step.source.offsets(index))
    if step.ratio == 1:
        image.index_copy_(0, at, new)
        return Changes(at, new.view(words.dtype))
    old = image.index_select(0, at)
    image.index_copy_(0, at, new)
    new_words = new.view(words.dtype)
    which = torch.ne(new_words, old.view(words.dtype)).nonzero().flatten()
    shift = step.ratio.bit_length() - 1  # words per element: a power of two
    positions = (at.index_select(0, which >> shift) << shift) | (which & (step.ratio - 1))
    return Changes(positions, new_words.index_select(0, which))


def _concat(found: Sequence[Changes]) -> Changes:
    if len(found) == 1:
        return found[0]
    return Changes(torch.cat([c.positions for c in found]), torch.cat([c.values for c in found]))


def _in_order(steps: Steps, found: Sequence[Changes]) -> Changes:
    """The steps' changes in ascending positions, where the steps' parts interleave: each step's changes are
    ascending, so they are cut at the step's parts' first words and the pieces put in the parts' order."""
    cuts = []
    for step, c in zip(steps.steps, found, strict=True):
        starts = torch.tensor(step.blocks[1:], dtype=torch.int64, device=c.positions.device)
        cuts.append([0, *torch.searchsorted(c.positions, starts).tolist(), c.positions.numel()])
    assert steps.order is not None
    pieces = [(found[s], cuts[s][i], cuts[s][i + 1]) for s, i in steps.order]
    return Changes(
        torch.cat([c.positions[a:b] for c, a, b in pieces]), torch.cat([c.values[a:b] for c, a, b in pieces])
    )


def _live(changes: Changes, words: Words) -> Changes:
    """``changes`` without positions in the padding between parts (a packed slot leaves it as it was)."""
    starts = words.starts(changes.positions.device)
    ends = starts + torch.tensor([s.words for s in words.parts], dtype=torch.int64, device=starts.device)
    part = (torch.searchsorted(starts, changes.positions, right=True) - 1).clamp_(min=0)
    keep = (changes.positions >= starts[part]) & (changes.positions < ends[part])
    return Changes(changes.positions[keep], changes.values[keep])
