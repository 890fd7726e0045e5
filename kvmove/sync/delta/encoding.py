"""The encodings of a delta: which words of a pull's payload changed, and their new values.

A pull's payload (its packed parts, laid out by :func:`kvmove.sync.planning.packing.pack_layout`) is compared as
integer *words* (int16 for BF16 and scales, uint8 where a part has an odd size): bits, never values, so NaN
payloads, -0.0 and +0.0 are told apart exactly. A word's *position* is its index in the payload (alignment
padding included, though padding never changes). Of the payload's ``n`` words ``k`` changed; four encodings
can carry that, each with the ``k`` values after the positions, in position order:

- ``dense``: the payload as packed (``layout bytes``);
- ``index``: the ``k`` positions, ascending (int32, int64 past 2**31 words);
- ``gaps``: the distance of each position from the one before (from -1 for the first), less one, in 16 bits:
  only where every distance is at most 2**16 (at 1% of words changed, spread as a training step spreads them,
  none comes near); decoded by one cumulative sum;
- ``bitmap``: one bit per word.

:func:`choose` takes the smallest, dense on ties, so a delta is never larger than the dense payload at any
changed fraction: gaps below about 1/16 of the words changed, the bitmap above (up to about 15/16), index where
gaps do not fit. Sections start at 16-byte boundaries, as packed parts do. Writing and reading are batched torch
work on the slot's device: no Python per element.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.sync.planning.packing import align, pack_layout


class Encoding(enum.StrEnum):
    DENSE = "dense"
    INDEX = "index"
    GAPS = "gaps"
    BITMAP = "bitmap"


GAP_LIMIT = 1 << 16
"""The longest distance between two changed words (or from -1 to the first) the ``gaps`` encoding stores."""


class Span(NamedTuple):
    """Words ``[start, start + words)`` of a payload (one part's bytes, in words)."""

    start: int
    words: int


class Words(NamedTuple):
    """How a pull's payload is compared: its word type, each non-empty part's words and its dense bytes."""

    dtype: torch.dtype
    parts: tuple[Span, ...]
    """One span per part with bytes, in payload order (padding lies between them)."""
    dense_bytes: int

    @property
    def words(self) -> int:
        """Positions of the payload, padding included (what a bitmap has a bit for)."""
        return self.dense_bytes // self.word_bytes

    @property
    def live_words(self) -> int:
        return sum(s.words for s in self.parts)

    @property
    def word_bytes(self) -> int:
        return self.dtype.itemsize

    def index_dtype(self) -> torch.dtype:
        return torch.int32 if self.words < 2**31 else torch.int64

    def starts(self, device: torch.device | str) -> torch.Tensor:
        """Each part's first position (int64, ascending): ``searchsorted(starts, p, right=True) - 1`` is the part
        of position ``p``."""
        return torch.tensor([s.start for s in self.parts], dtype=torch.int64, device=device)


class Changes(NamedTuple):
    """The words of a pull that changed: positions in the payload (int64, ascending) and new values."""

    positions: torch.Tensor
    values: torch.Tensor


def payload_words(sizes: Sequence[int]) -> Words:
    """The words of a payload whose parts have ``sizes`` bytes (int16 words where every part allows it)."""
    layout = pack_layout(sizes)
    even = all(n % 2 == 0 and o % 2 == 0 for n, o in zip(sizes, layout.offsets, strict=True))
    dtype, w = (torch.int16, 2) if even else (torch.uint8, 1)
    parts = tuple(Span(off // w, n // w) for n, off in zip(sizes, layout.offsets, strict=True) if n)
    return Words(dtype, parts, layout.nbytes)


def encoded_bytes(words: Words, changed: int, encoding: Encoding) -> int:
    """Bytes ``encoding`` takes for ``changed`` of the payload's words."""
    if encoding is Encoding.DENSE:
        return words.dense_bytes
    values = changed * words.word_bytes
    if encoding is Encoding.INDEX:
        return align(changed * words.index_dtype().itemsize) + values
    if encoding is Encoding.GAPS:
        return align(changed * 2) + values
    return align(-(-words.words // 8)) + values


def choose(words: Words, changed: int, gap: int) -> Encoding:
    """The smallest encoding of ``changed`` words whose positions lie at most ``gap`` apart (from -1 for the
    first: :func:`longest_gap`): dense when nothing is smaller, ``gaps`` only where they fit."""
    best = Encoding.DENSE
    for e in (Encoding.INDEX, Encoding.GAPS, Encoding.BITMAP):
        if e is Encoding.GAPS and gap > GAP_LIMIT:
            continue
        if encoded_bytes(words, changed, e) < encoded_bytes(words, changed, best):
            best = e
    return best


def longest_gap(positions: torch.Tensor) -> int:
    """The longest distance between ascending ``positions`` (from -1 for the first; 0: none)."""
    return int(_gaps(positions).max()) if positions.numel() else 0


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    return torch.diff(positions, prepend=positions.new_full((1,), -1))


def most_changed(words: Words) -> int:
    """The most changed words an encoding carries in fewer bytes than dense (-1: none, not even zero changes):
    past it a pull goes dense, and a trainer can stop comparing as soon as more changed."""
    lo, hi = -1, words.words  # the encodings grow with the changes: the first k they lose at bounds the search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if choose(words, mid, 1) is Encoding.DENSE:
            hi = mid - 1
        else:
            lo = mid
    return lo


def delta_bytes(dense_bytes: int, changed_fraction: float, word_bytes: int = 2) -> int:
    """Bytes a delta of one region of ``dense_bytes`` takes when ``changed_fraction`` of its words changed: the
    smallest encoding, never more than dense (the price a simulator puts on a delta sync of that region)."""
    if not 0.0 <= changed_fraction <= 1.0:
        raise ValueError(f"changed fraction {changed_fraction} is not in [0, 1]")
    n = dense_bytes // word_bytes
    words = Words(torch.int16 if word_bytes == 2 else torch.uint8, (Span(0, n),), dense_bytes)
    changed = round(changed_fraction * n)
    # changes spread uniformly: about changed * (1 - f)**GAP_LIMIT gaps are longer than the gaps encoding stores
    fits = changed * math.exp(-GAP_LIMIT * changed_fraction) < 0.5
    return encoded_bytes(words, changed, choose(words, changed, 1 if fits else GAP_LIMIT + 1))


# -- the bytes ---------------------------------------------------------------------------------------------------
def write(buf: torch.Tensor, words: Words, encoding: Encoding, positions: torch.Tensor, values: torch.Tensor) -> int:
    """Write ``values`` (the changed words) and their ``positions`` (int64, ascending) into ``buf`` (uint8) in
    ``encoding``; returns its bytes."""
    k = values.numel()
    if encoding is Encoding.INDEX:
        head = positions.to(words.index_dtype())
        buf[: head.numel() * head.element_size()].view(head.dtype).copy_(head)
        at = align(k * head.element_size())
    elif encoding is Encoding.GAPS:  # gap - 1, in 16 bits (as int16: values past 2**15 wrap)
        gap = _gaps(positions) - 1
        buf[: 2 * k].view(torch.int16).copy_(torch.where(gap >= 1 << 15, gap - GAP_LIMIT, gap))
        at = align(2 * k)
    else:
        nbits = -(-words.words // 8)
        bits = torch.zeros(nbits, dtype=torch.int32, device=buf.device)  # int32: index_add_ on every device
        # NOTE: the bits of one byte are distinct, so summing them is or-ing them
        bits.index_add_(0, positions >> 3, torch.ones_like(positions, dtype=torch.int32) << (positions & 7).int())
        buf[:nbits].copy_(bits)
        at = align(nbits)
    buf[at : at + k * words.word_bytes].view(words.dtype).copy_(values)
    return at + k * words.word_bytes


class Delta(NamedTuple):
    """A delta as read from a receive slot: positions (int64, ascending) and the new words (a view of the slot)."""

    positions: torch.Tensor
    values: torch.Tensor


def read(buf: torch.Tensor, words: Words, encoding: Encoding, changed: int) -> Delta:
    """The positions and values of a delta in ``buf`` (the values are a view of ``buf``: use them before it is
    overwritten)."""
    if encoding is Encoding.INDEX:
        idt = words.index_dtype()
        positions = buf[: changed * idt.itemsize].view(idt).to(torch.int64)
        at = align(changed * idt.itemsize)
    elif encoding is Encoding.GAPS:
        gap = buf[: 2 * changed].view(torch.int16).to(torch.int64) & (GAP_LIMIT - 1)
        positions = torch.cumsum(gap + 1, 0) - 1
        at = align(2 * changed)
    else:
        nbits = -(-words.words // 8)
        positions = bit_positions(buf[:nbits], changed)
        at = align(nbits)
    return Delta(positions, buf[at : at + changed * words.word_bytes].view(words.dtype))


_SET = [[j for j in range(8) if i >> j & 1] for i in range(256)]
_COUNT = torch.tensor([len(b) for b in _SET], dtype=torch.int64)
_BITS = torch.tensor([b + [0] * (8 - len(b)) for b in _SET], dtype=torch.int64).view(-1)
"""Per byte value: how many bits it has set, and which (padded to 8)."""


def bit_positions(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` set bits of ``bits`` (bit ``i % 8`` of byte ``i // 8``), ascending (int64): only the bytes
    with a bit set are read, each expanded by table."""
    byte = bits.nonzero().flatten()
    value = bits.index_select(0, byte).to(torch.int64)
    per = _COUNT.to(bits.device).index_select(0, value)
    which = torch.repeat_interleave(torch.arange(byte.numel(), device=bits.device), per, output_size=count)
    rank = torch.arange(count, device=bits.device) - (torch.cumsum(per, 0) - per).index_select(0, which)
    bit = _BITS.to(bits.device).index_select(0, value.index_select(0, which) * 8 + rank)
    return byte.index_select(0, which) * 8 + bit
