"""The engine's side of a delta sync: a patch decoded from the receive slot, applied through the pull's landing
program.

A packed pull lands by a program of byte copies from the receive slot into parameter regions
(``kvmove.sync.transforms.Lander``). For a delta the engine first reads the changed words and their positions out
of the slot, then runs that program backwards (every region's current bytes copied into the slot: the payload as
the engine holds it, which is the trainer's image of it), scatters the changed words into it in one indexed copy
and runs the program forwards: every region then holds the new payload, bit for bit, whatever its layout (fused,
strided, FP8 weights and scales). Parameters not touched by the pull are never read. All of it is batched torch
work on the slot's device (CUDA: no host synchronization before the landing's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.sync.delta.encoding import Encoding, Words, payload_words, positions, read
from kvmove.sync.programs import Program


class Patch(NamedTuple):
    """A delta-encoded pull as the engine received it: its encoding, changed words and payload layout."""

    encoding: Encoding
    changed: int
    words: Words

    @classmethod
    def of(cls, encoding: str, changed: int, sizes: Sequence[int]) -> Patch | None:
        """The patch of a pull whose parts have ``sizes`` bytes, packed as ``encoding`` (None: dense, landed as
        it is)."""
        if Encoding(encoding) is Encoding.DENSE:
            return None
        return cls(Encoding(encoding), changed, payload_words(sizes))

    def apply(self, program: Program, buf: torch.Tensor) -> None:
        """Turn the delta in ``buf`` into the pull's full new payload, ready for ``program`` to land."""
        if program.quantize:
            raise ValueError("a delta lands only through copies; this pull's program quantizes")
        index, values = read(buf, self.words, self.encoding, self.changed)
        for c in program.copies:  # the payload as the parameters hold it now
            c.src.copy_(c.dst, non_blocking=True)
        flat = buf[: self.words.dense_bytes].view(self.words.dtype)
        flat.index_put_((positions(self.words, index),), values)
