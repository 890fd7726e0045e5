"""The encodings of a delta: which words of a pull's payload changed, and their new values.

A pull's payload (its packed parts, laid out by :func:`kvmove.sync.planning.packing.pack_layout`) is compared as
integer *words* (int16 for BF16 and scales, uint8 where a part has an odd size): bits, never values, so NaN
payloads, -0.0 and +0.0 are told apart exactly. Of ``n`` live words (the parts' bytes, not their alignment
padding) ``k`` changed; three encodings can carry that:

- ``dense``: the payload as packed (``layout bytes``);
- ``index``: the ``k`` positions (int32, int64 past 2**31 words), then the ``k`` values;
- ``bitmap``: one bit per live word, then the ``k`` values.

:func:`choose` takes the smallest, dense on ties, so a delta is never larger than the dense payload at any
changed fraction. Sections start at 16-byte boundaries, as packed parts do.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.sync.planning.packing import align, pack_layout


class Encoding(enum.StrEnum):
    DENSE = "dense"
    INDEX = "index"
    BITMAP = "bitmap"


class Span(NamedTuple):
    """Live words ``[start, start + words)`` of a payload (one part's bytes, in words)."""

    start: int
    words: int


class Words(NamedTuple):
    """How a pull's payload is compared: its word type, its live spans (merged) and its dense bytes."""

    dtype: torch.dtype
    spans: tuple[Span, ...]
    dense_bytes: int

    @property
    def live_words(self) -> int:
        return sum(s.words for s in self.spans)

    @property
    def word_bytes(self) -> int:
        return self.dtype.itemsize

    def index_dtype(self) -> torch.dtype:
        return torch.int32 if self.live_words < 2**31 else torch.int64


def payload_words(sizes: Sequence[int]) -> Words:
    """The live words of a payload whose parts have ``sizes`` bytes (int16 words where every part allows it)."""
    layout = pack_layout(sizes)
    even = all(n % 2 == 0 and o % 2 == 0 for n, o in zip(sizes, layout.offsets, strict=True))
    dtype, w = (torch.int16, 2) if even else (torch.uint8, 1)
    spans: list[Span] = []
    for n, off in zip(sizes, layout.offsets, strict=True):
        if not n:
            continue
        start, words = off // w, n // w
        if spans and spans[-1].start + spans[-1].words == start:
            spans[-1] = Span(spans[-1].start, spans[-1].words + words)
        else:
            spans.append(Span(start, words))
    return Words(dtype, tuple(spans), layout.nbytes)


def encoded_bytes(words: Words, changed: int, encoding: Encoding) -> int:
    """Bytes ``encoding`` takes for ``changed`` of the payload's live words."""
    if encoding is Encoding.DENSE:
        return words.dense_bytes
    values = changed * words.word_bytes
    if encoding is Encoding.INDEX:
        return align(changed * words.index_dtype().itemsize) + values
    return align(-(-words.live_words // 8)) + values


def choose(words: Words, changed: int) -> Encoding:
    """The smallest encoding of ``changed`` live words (dense when nothing is smaller)."""
    best = Encoding.DENSE
    for e in (Encoding.INDEX, Encoding.BITMAP):
        if encoded_bytes(words, changed, e) < encoded_bytes(words, changed, best):
            best = e
    return best


def delta_bytes(dense_bytes: int, changed_fraction: float, word_bytes: int = 2) -> int:
    """Bytes a delta of one region of ``dense_bytes`` takes when ``changed_fraction`` of its words changed: the
    smallest encoding, never more than dense (the price a simulator puts on a delta sync of that region)."""
    if not 0.0 <= changed_fraction <= 1.0:
        raise ValueError(f"changed fraction {changed_fraction} is not in [0, 1]")
    n = dense_bytes // word_bytes
    words = Words(torch.int16 if word_bytes == 2 else torch.uint8, (Span(0, n),), dense_bytes)
    changed = round(changed_fraction * n)
    return encoded_bytes(words, changed, choose(words, changed))


# -- the bytes ---------------------------------------------------------------------------------------------------
def live(buf: torch.Tensor, words: Words) -> torch.Tensor:
    """The live words of the payload in ``buf`` (uint8) as one 1-D tensor: a view when they are one span."""
    flat = buf[: words.dense_bytes].view(words.dtype)
    if len(words.spans) == 1:
        s = words.spans[0]
        return flat[s.start : s.start + s.words]
    return torch.cat([flat[s.start : s.start + s.words] for s in words.spans])


def positions(words: Words, index: torch.Tensor) -> torch.Tensor:
    """Live-word indices -> word positions in the payload (int64)."""
    index = index.to(torch.int64)
    if len(words.spans) == 1:
        return index + words.spans[0].start
    ends = torch.tensor([0, *_cumulative(words)], dtype=torch.int64, device=index.device)
    starts = torch.tensor([s.start for s in words.spans], dtype=torch.int64, device=index.device)
    span = torch.searchsorted(ends[1:], index, right=True)
    return index - ends[span] + starts[span]


def _cumulative(words: Words) -> list[int]:
    out, at = [], 0
    for s in words.spans:
        at += s.words
        out.append(at)
    return out


def write(
    buf: torch.Tensor, words: Words, encoding: Encoding, mask: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> int:
    """Write ``values`` (the changed words, in order) and where they are (``mask`` over the live words, or their
    ``index``, ascending) into ``buf`` in ``encoding``; returns its bytes."""
    k = values.numel()
    if encoding is Encoding.INDEX:
        head = index.to(words.index_dtype())
        buf[: head.numel() * head.element_size()].view(head.dtype).copy_(head)
        at = align(k * head.element_size())
    else:
        bits = pack_bits(mask)
        buf[: bits.numel()].copy_(bits)
        at = align(bits.numel())
    buf[at : at + k * words.word_bytes].view(words.dtype).copy_(values)
    return at + k * words.word_bytes


def read(buf: torch.Tensor, words: Words, encoding: Encoding, changed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(live-word indices, values) of a delta in ``buf``, as new tensors (``buf`` may be overwritten next)."""
    if encoding is Encoding.INDEX:
        idt = words.index_dtype()
        index = buf[: changed * idt.itemsize].view(idt).to(torch.int64)
        at = align(changed * idt.itemsize)
    else:
        nbits = -(-words.live_words // 8)
        index = unpack_bits(buf[:nbits], words.live_words).nonzero().flatten()
        at = align(nbits)
    values = buf[at : at + changed * words.word_bytes].view(words.dtype).clone()
    return index, values


_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, bit ``i % 8`` of byte ``i // 8`` (little-endian bit order)."""
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    return (padded.view(-1, 8) * _BIT.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack_bits` inverted: the first ``n`` bits as bools."""
    return (bits.unsqueeze(1) & _BIT.to(bits.device)).ne(0).flatten()[:n]
