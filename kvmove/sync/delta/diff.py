"""The trainer's comparison of a pull's new payload with the image it last served, read straight from the sources.

A packed pull is packed by a program of batched copies (``kvmove.sync.programs``), each from a source view into
a stack of whole parts of the serve slot. The image a trainer rank keeps of a pull is laid out as the slot, so
each copy's slot view, placed on the image instead, is where the image holds what that copy would write.
:func:`diff` compares each copy's source with that view as the payload's words (int16, or bytes: bits, never
values), so the payload is never packed densely:

1. ``ne`` over the source and the image view, and the changed words counted;
2. if they are no more than an encoding carries in fewer bytes than dense (``limit``), the positions of the
   changed words (a ``nonzero``), their new values gathered from the source's storage and written, only they,
   into the image.

That is two reads of the pull's bytes, one flag per word, and work proportional to the changes, where a dense
pack reads and writes every byte. Where too many words changed, nothing is gathered: the pull goes dense (the
caller packs it and refreshes the image from the slot). The three passes over every word run on the device's
own fastest kernels (:data:`FINDERS`): on a CPU, numpy's (its ``!=`` and ``flatnonzero`` are 3-5x faster than
torch's on one thread), over 64-bit words first and only the differing ones' lanes after (:mod:`kvmove.sync.
delta.wide`), on a GPU, torch's; on a GPU with Triton, the comparison is instead a
stream compaction of the whole pull in two kernel launches (:mod:`kvmove.sync.delta.triton_diff`).

Where the program quantizes (FP8 computed on the trainer) there is no source of the payload's bytes to compare:
the payload is packed into the slot first and the slot is compared instead (:func:`slot_steps`); the alignment
padding between its parts, which the pack leaves as it was, is dropped from the result.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from kvmove.quant.quantizer import default_backend
from kvmove.sync.delta import wide
from kvmove.sync.delta.encoding import Changes, Words
from kvmove.sync.programs import Program

if TYPE_CHECKING:
    from kvmove.sync.delta.triton_diff import Rows, Table

Geometry = tuple[tuple[int, ...], tuple[int, ...]]
Mask = Any
"""One flag per word of a step (a numpy array or a torch tensor: the finder's own)."""


class Finder(NamedTuple):
    """The passes over every word of a pull, on one kind of device: the flags of the words that differ, flags
    cleared at given indices, how many are set, and their row-major indices (int64, ascending, a torch tensor on
    the device); and whether a pull is packed before it is compared."""

    ne: Callable[[torch.Tensor, torch.Tensor], Mask]
    clear: Callable[[Mask, torch.Tensor], None]
    count: Callable[[Mask], int]
    nonzero: Callable[[Mask], torch.Tensor]
    packs_first: bool
    """Compare the packed slot, one pass of each kind per pull (:func:`slot_steps`), rather than each copy's
    source (:func:`program_steps`: a pass of each kind per copy, saving the pack's write)."""
    packed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], Changes | None] | None = None
    """The whole comparison of a packed slot in one call (new words, image, padding, limit), where the device
    has one that beats the passes above (None: the passes)."""
    packed_suits: Callable[[torch.Tensor, torch.Tensor], bool] | None = None
    """Whether ``packed`` beats the passes on this payload and image (None: always); where not, the passes run."""


def _numpy_ne(a: torch.Tensor, b: torch.Tensor) -> Mask:
    return np.not_equal(a.detach().numpy(), b.detach().numpy())


def _numpy_clear(mask: Mask, index: torch.Tensor) -> None:
    np.put(mask, index.numpy(), False)


def _numpy_count(mask: Mask) -> int:
    return int(np.count_nonzero(mask))


def _numpy_nonzero(mask: Mask) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(mask).astype(np.int64, copy=False))


def _torch_count(mask: Mask) -> int:
    return int(torch.count_nonzero(mask))


def _torch_clear(mask: Mask, index: torch.Tensor) -> None:
    mask.index_fill_(0, index, False)


def _torch_nonzero(mask: Mask) -> torch.Tensor:
    return mask.flatten().nonzero().flatten()


FINDERS: dict[str, Finder] = {
    "cpu": Finder(
        _numpy_ne,
        _numpy_clear,
        _numpy_count,
        _numpy_nonzero,
        packs_first=True,
        packed=wide.compare,
        packed_suits=wide.suits,
    ),
    "cuda": Finder(torch.ne, _torch_clear, _torch_count, _torch_nonzero, packs_first=False),
}
"""The finder of each device type (any other uses CUDA's). On a CPU every call costs tens of microseconds of
dispatch and a pull's copies are many (an MoE layer's experts: hundreds), so the pull is packed by its one
batched program (a memory copy) and compared as one run of words, 64-bit words first (:mod:`kvmove.sync.delta.
wide`); a GPU compares each copy's source, without the pack's write."""


def finder(device: torch.device) -> Finder:
    """The finder of ``device``'s type."""
    return FINDERS.get(device.type, FINDERS["cuda"])


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
    """One batched copy of a pack program, as the payload's words: the source of the new payload, and the slot
    view it packs into (the same on the image) - a stack of whole parts."""

    src: torch.Tensor
    source: Flat
    view: Geometry
    """The slot view's shape and strides (the source's shape), in words."""
    slot: Flat
    """The slot view's offsets, from the start of the slot (in words)."""
    blocks: tuple[int, ...]
    """The first word of each stacked part (ascending)."""

    def on(self, image: torch.Tensor) -> torch.Tensor:
        """The step's slot view placed on ``image`` (uint8, laid out as the slot)."""
        return image.view(self.src.dtype).as_strided(*self.view, self.slot.at)

    @property
    def end(self) -> int:
        """The word past the step's last."""
        shape, stride = self.slot.geometry
        return self.slot.at + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1


class Steps(NamedTuple):
    """The steps of one pull, and the order of their parts in the payload where they interleave (None: the
    steps' words, concatenated, are in ascending positions)."""

    steps: tuple[Step, ...]
    order: tuple[tuple[int, int], ...] | None
    """(step, stacked part) in payload order."""
    packed: bool
    """The steps read the packed slot (:func:`slot_steps`): run the pack first."""
    padding: torch.Tensor | None
    """The positions of the alignment padding between the parts (which a pack leaves as it was) where the steps
    read the packed slot: never reported as changed."""
    tables: dict[int, Table | None]
    """The Triton descriptor table of these steps per image address, built at the first comparison (None: the
    finder compares them); a trainer keeps a pull's steps, so its table is built once."""


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
    """The copies of ``program`` (packing into ``buf``) as steps; None where it quantizes, converts, or copies
    views that are not stacks of whole parts or cannot be read as the payload's words (then compare the packed
    slot: :func:`slot_steps`)."""
    if program.quantize:
        return None
    steps = []
    for c in program.copies:
        step = _step(c.dst, c.src, buf, words)
        if step is None:
            return None
        steps.append(step)
    steps.sort(key=lambda s: s.blocks[0])
    if all(a.end <= b.blocks[0] for a, b in itertools.pairwise(steps)):
        return Steps(tuple(steps), None, packed=False, padding=None, tables={})
    order = sorted((b, s, i) for s, step in enumerate(steps) for i, b in enumerate(step.blocks))
    return Steps(tuple(steps), tuple((s, i) for _, s, i in order), packed=False, padding=None, tables={})


def _step(dst: torch.Tensor, src: torch.Tensor, buf: torch.Tensor, words: Words) -> Step | None:
    """One copy of ``src`` into ``dst`` (a view of ``buf``) as a step over words; None where it cannot be one."""
    rel, w = dst.data_ptr() - buf.data_ptr(), words.word_bytes
    if src.dtype != dst.dtype or not dst.dim() or rel % w or dst.element_size() % w:
        return None  # a copy that converts (its bytes exist only once packed), or elements narrower than a word
    try:
        dst_w, src_w = dst.view(words.dtype), src.view(words.dtype)
    except RuntimeError:  # a row, stride or offset that is not a multiple of the word
        return None
    geometry = merged(dst_w.shape, dst_w.stride())
    if len(geometry[0]) > 2 or geometry[1][-1] != 1:
        return None
    at, ratio = rel // w, dst.element_size() // w
    blocks = tuple(at + i * dst.stride(0) * ratio for i in range(dst.shape[0]))
    view = (tuple(dst_w.shape), tuple(dst_w.stride()))
    return Step(src_w, Flat.of(src_w), view, Flat(buf, at, geometry), blocks)


def slot_steps(buf: torch.Tensor, words: Words) -> Steps:
    """The packed payload in ``buf`` as one step over its words."""
    src = buf[: words.dense_bytes].view(words.dtype)
    line = ((src.numel(),), (1,))
    step = Step(src, Flat.of(src), line, Flat(buf, 0, line), (0,))
    return Steps((step,), None, packed=True, padding=padding(words, buf.device), tables={})


@functools.lru_cache(maxsize=1024)
def padding(words: Words, device: torch.device) -> torch.Tensor:
    """The positions of the payload that no part holds (int64, ascending; one tensor per payload layout, kept:
    a CPU trainer compares each pull's packed slot every delta sync - never written to)."""
    ends = [p.start + p.words for p in words.parts]
    runs = [range(a, b) for a, b in zip([0, *ends], [p.start for p in words.parts] + [words.words], strict=True)]
    return torch.tensor([i for r in runs for i in r], dtype=torch.int64, device=device)


def diff(steps: Steps, image: torch.Tensor, words: Words, limit: int, backend: str | None = None) -> Changes | None:
    """The words of the new payload (read by ``steps``) that differ from ``image`` (uint8, laid out as the
    slot), which then takes the new payload's values. None, the image left as it was, where more than ``limit``
    words changed (no encoding would be smaller than dense).

    ``backend``: ``torch`` (the device's :data:`FINDERS`) or ``triton`` (:mod:`kvmove.sync.delta.triton_diff`: a
    stream compaction of every step in two launches, where every step is a stack of contiguous rows and no
    padding is to be dropped; else the finder); by default Triton for CUDA tensors where it is installed."""
    t = _table(steps, image, words) if (backend or default_backend(image)) == "triton" else None
    if t is not None:
        return _diff_table(steps, t, words, limit)
    find = finder(image.device)
    if steps.packed and find.packed is not None:
        src = steps.steps[0].src
        if find.packed_suits is None or find.packed_suits(src, image):
            return find.packed(src, image, steps.padding, limit)
    masks = [find.ne(step.src, step.on(image)) for step in steps.steps]
    if steps.padding is not None:
        find.clear(masks[0], steps.padding)
    if sum(find.count(m) for m in masks) > limit:
        return None
    flat = image.view(words.dtype)
    found = [_changed(step, flat, find.nonzero(m).to(image.device)) for step, m in zip(steps.steps, masks, strict=True)]
    return _concat(found) if steps.order is None else _in_order(steps, found)


def _rows(steps: Steps, words: Words) -> list[Rows] | None:
    """Every step as word rows (None where one is not a stack of contiguous rows, or a packed slot's
    padding must be dropped: the finder compares those)."""
    from kvmove.sync.delta.triton_diff import rows_of

    if steps.padding is not None:
        return None
    rows = [rows_of(s.src, s.view, s.slot.at, words.dtype) for s in steps.steps]
    return None if any(r is None for r in rows) else [r for r in rows if r is not None]


def _table(steps: Steps, image: torch.Tensor, words: Words) -> Table | None:
    """The Triton descriptor table of ``steps`` on ``image``, built once per steps and image (None: the finder)."""
    from kvmove.sync.delta.triton_diff import table

    if image.data_ptr() not in steps.tables:
        rows = _rows(steps, words)
        steps.tables[image.data_ptr()] = None if rows is None else table(rows, image, words.dtype)
    return steps.tables[image.data_ptr()]


def _diff_table(steps: Steps, t: Table, words: Words, limit: int) -> Changes | None:
    """:func:`diff` by the Triton compaction: two launches for every step of the pull and one host synchronization
    (each step's count)."""
    from kvmove.sync.delta.triton_diff import compact, count

    counts = count(t)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    bounds = [0, *ends.index_select(0, t.last).tolist()]
    if bounds[-1] > limit:
        return None
    every = Changes(*compact(t, counts, ends, bounds[-1]))  # in step order
    if steps.order is None:
        return every
    return _in_order(steps, [Changes(*(x[a:b] for x in every)) for a, b in itertools.pairwise(bounds)])


def _changed(step: Step, image: torch.Tensor, index: torch.Tensor) -> Changes:
    """The changed words ``index`` (row-major in the step's view) of ``step``, written into ``image`` (flat
    words): their positions in the payload and new values."""
    at = step.slot.offsets(index)
    new = step.source.storage.index_select(0, step.source.offsets(index))
    image.index_copy_(0, at, new)
    return Changes(at, new)


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
