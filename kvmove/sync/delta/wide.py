"""The CPU's comparison of a packed payload with its image, in 64-bit words first.

On a CPU the trainer compares a pull's packed slot with the image it last served (:func:`kvmove.sync.delta.diff.
slot_steps`). Compared as the payload's own words (int16, or bytes), the floor is ``flatnonzero`` over one flag
per word. At the changed fractions of an RL step (about 2% of BF16 elements) most 64-bit runs of words are
unchanged (at 2.3%, 1 - 0.977**4: about 9% of them differ), so :func:`compare`:

1. compares the payload and the image as ``uint64`` (a quarter of the int16 compares, same bytes read) and finds
   the wide words that differ (``flatnonzero`` over a quarter of the flags);
2. gathers only those wide words, of both, and compares them lane by lane (the payload's words: bits, never
   values, so NaN payloads and -0.0/+0.0 are told apart exactly), dropping the lanes that are alignment padding
   (which a pack leaves as it was: never a change);
3. counts the changed lanes exactly against the limit (nothing is written past it), takes their positions and
   new values from the gathered lanes (no second gather), and writes the differing wide words whole into the
   image, its own padding lanes put back first.

A payload whose bytes are not a multiple of 8 has a tail of fewer than 8 bytes, compared word by word. Where more
than :data:`BUSY` of the first chunk's wide words differ (much changed: the pull may well go dense by size), the
gathers would cost more than they save: :func:`suits` says so, and the finder's own passes compare the payload word
by word instead (``kvmove.sync.delta.diff.FINDERS``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvmove.sync.delta.encoding import Changes

WIDE = np.dtype(np.uint64)
CHUNK = 1 << 17
"""Wide words compared at a time (1 MiB of payload): the chunk's passes after the first read it from cache."""
BUSY = 0.25
"""The fraction of the first chunk's wide words that differ past which a pull is compared word by word (at 9%,
2.3% of int16 words changed, the wide words are faster; at 47%, 14.5% changed, the words are)."""
SPARSE = 0.025
"""numpy's ``flatnonzero`` of a bool array takes one of two loops, by the fraction of flags set: up to 10%, a
``memchr`` per set flag (about 15 ns each on the development host), past it a branchless loop (about 0.5 ns a
flag, set or not). Wide words differ at about 9% at an RL step's changes: the slowest point of the first loop.
Past this fraction, :func:`_differing` appends set flags to take the second; below it, the first is faster."""


class Piece(NamedTuple):
    """One chunk's changes: its first wide word, the differing wide words (indices in the chunk) and their old
    values (put back where the whole comparison is refused), the changed words' positions in the payload and
    their new values."""

    at: int
    wide: np.ndarray
    old: np.ndarray
    positions: np.ndarray
    values: np.ndarray


def suits(new: torch.Tensor, image: torch.Tensor) -> bool:
    """Whether :func:`compare` beats comparing ``new`` word by word: no more than :data:`BUSY` of its first chunk's
    wide words differ from ``image``'s."""
    a_bytes = new.numpy().view(np.uint8)
    body = min(a_bytes.size // WIDE.itemsize, CHUNK) * WIDE.itemsize
    a, b = a_bytes[:body].view(WIDE), image.numpy()[:body].view(WIDE)
    return bool(np.count_nonzero(a != b) <= BUSY * a.size)


def compare(new: torch.Tensor, image: torch.Tensor, padding: torch.Tensor | None, limit: int) -> Changes | None:
    """The words of ``new`` (the packed payload as its int16 or uint8 words, on the CPU) that differ from
    ``image`` (uint8, laid out as the payload, at least as long), positions ``padding`` (ascending; None: none)
    never reported; ``image`` then takes the new words. None, the image left as it was, where more than
    ``limit`` words changed."""
    word = np.dtype(new.numpy().dtype)
    a_bytes = new.numpy().view(np.uint8)
    b_bytes = image.numpy()[: a_bytes.size]
    body = a_bytes.size // WIDE.itemsize * WIDE.itemsize
    a, b = a_bytes[:body].view(WIDE), b_bytes[:body].view(WIDE)
    pad = np.empty(0, dtype=np.int64) if padding is None else padding.numpy()
    first = body // word.itemsize  # the tail's first position
    split = int(np.searchsorted(pad, first))
    tail = _tail(a_bytes[body:].view(word), b_bytes[body:].view(word), pad[split:] - first)
    starts = range(0, a.size, CHUNK)
    cuts = np.searchsorted(pad[:split], np.array([*starts, a.size], dtype=np.int64) * (WIDE.itemsize // word.itemsize))
    pieces: list[Piece] = []
    count = tail.size
    for i, at in enumerate(starts):
        piece = _chunk(a, b, word, at, pad[cuts[i] : cuts[i + 1]], limit - count)
        if piece is None:
            _undo(b, pieces)
            return None
        pieces.append(piece)
        count += piece.positions.size
    positions, values = [p.positions for p in pieces], [p.values for p in pieces]
    if tail.size:
        b_bytes[body:].view(word)[tail] = a_bytes[body:].view(word)[tail]
        positions.append(tail + first)
        values.append(a_bytes[body:].view(word)[tail])
    return Changes(torch.from_numpy(_joined(positions, np.int64)), torch.from_numpy(_joined(values, word)))


def _chunk(a: np.ndarray, b: np.ndarray, word: np.dtype, at: int, padding: np.ndarray, limit: int) -> Piece | None:
    """:func:`compare` of the chunk of wide words from ``at``, as ``word`` lanes (``padding``: the payload's
    positions in the chunk); None, ``b`` left as it was, where more than ``limit`` words changed."""
    lanes = WIDE.itemsize // word.itemsize
    shift = lanes.bit_length() - 1
    ca, cb = a[at : at + CHUNK], b[at : at + CHUNK]
    wide = _differing(ca, cb)
    pad_words = (padding >> shift) - at
    padded = int(np.count_nonzero(np.diff(pad_words))) + 1 if pad_words.size else 0
    if wide.size - padded > limit:  # each differing wide word that holds no padding holds a change
        return None
    ga, gb = ca[wide], cb[wide]
    la, lb = ga.view(word).reshape(-1, lanes), gb.view(word).reshape(-1, lanes)
    changed = la != lb
    row = np.searchsorted(wide, pad_words)
    hit = row < wide.size
    hit[hit] = wide[row[hit]] == pad_words[hit]
    rows, cols = row[hit], padding[hit] & (lanes - 1)
    changed[rows, cols] = False
    flat = np.flatnonzero(changed)
    if flat.size > limit:
        return None
    positions = ((wide[flat >> shift] + at) << shift) | (flat & (lanes - 1))
    values = la.reshape(-1)[flat]
    la[rows, cols] = lb[rows, cols]  # the image keeps its own padding
    cb[wide] = ga
    return Piece(at, wide, gb, positions, values)


def _undo(b: np.ndarray, pieces: list[Piece]) -> None:
    """A refused comparison: the chunks written so far get their old words back."""
    for done in pieces:
        b[done.at + done.wide] = done.old


def _joined(arrays: list[np.ndarray], dtype: np.dtype | type) -> np.ndarray:
    if not arrays:
        return np.empty(0, dtype=dtype)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _differing(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The indices (int64, ascending) where ``a`` and ``b`` differ, by the faster of numpy's two loops (:data:
    `SPARSE`)."""
    n = a.size
    flags = np.empty(n + n // 9 + 2, dtype=bool)  # set flags appended: over 10% of the whole set
    np.not_equal(a, b, out=flags[:n])
    k = int(np.count_nonzero(flags[:n]))
    if k <= SPARSE * n:
        return np.flatnonzero(flags[:n])
    flags[n:] = True
    return np.flatnonzero(flags)[:k]


def _tail(new: np.ndarray, old: np.ndarray, padding: np.ndarray) -> np.ndarray:
    """The positions (in the tail) of the tail's changed words, padding dropped."""
    changed = new != old
    changed[padding] = False
    return np.flatnonzero(changed)
