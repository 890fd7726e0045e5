"""Packing: entry payloads at 16-byte-aligned offsets of one uint8 slot, identically on both sides.

The trainer packs the parts of the entries of one pull, in request order, into a registered slot (each entry
as its :class:`ServeSpec` and transform say: kvmove.sync.transforms); the engine carves views at the same
offsets from its receive buffer and lands each. Both sides derive the offsets from the same
:func:`pack_layout` of the same parts' sizes, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.sync.planning.entries import Entry, EntryPlan
from kvmove.sync.planning.plan import Box, ShardingPlan, relative_view
from kvmove.sync.planning.recording import StridedView, replay

ALIGN = 16


class PartSpec(NamedTuple):
    """One part of an entry's payload, as the serving trainer rank produces it."""

    part: str
    """``"data"`` (the tensor's own bytes), ``"weight"`` or ``"scale"`` (of the quantized cover)."""
    src: StridedView | None
    """Plain: the region as a view of the full tensor; quantized: the region's view inside its part; None: the
    loader's op chain (plain), or the whole box read (a piece of a cover)."""
    ops: tuple
    dtype: torch.dtype
    nbytes: int


class ServeSpec(NamedTuple):
    """What a trainer rank needs to serve one entry (sent once, at init; cached by pull id)."""

    transform: str
    tensor: str
    shape: tuple[int, ...]
    """Full shape of ``tensor``."""
    box: Box
    shard: bool
    """Read from the rank's raw shard (else from the tensor it materialized)."""
    parts: tuple[PartSpec, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(p.nbytes for p in self.parts)

    @classmethod
    def of(cls, entry: Entry, plan: ShardingPlan, entries: EntryPlan, shape: tuple[int, ...]) -> ServeSpec:
        parts: list[PartSpec] = []
        for i in entry.regions:
            r, q = plan.regions[i], entries.quant[i]
            if q is None:
                parts.append(PartSpec("data", r.src, r.ops, r.dtype, r.nbytes))
            else:
                parts.append(PartSpec(q.part, q.view, (), r.dtype, r.nbytes))
        if entry.cover >= 0:
            parts.append(PartSpec("data", None, (), entries.covers[entry.cover].dtype, entry.nbytes))
        return cls(entry.transform, entry.tensor, shape, entry.box, entry.shard, tuple(parts))


class PackLayout(NamedTuple):
    offsets: tuple[int, ...]
    nbytes: int


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack_layout(sizes: Sequence[int]) -> PackLayout:
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at = align(at + n)
    return PackLayout(tuple(offsets), at)


def payload(part: PartSpec, shape: tuple[int, ...], full: torch.Tensor) -> torch.Tensor:
    """A plain part's data from the full HF tensor the trainer holds (a strided view, no copy when possible)."""
    if part.src is not None:
        return relative_view(part.src, shape, Box.full(shape)).apply(full)
    return replay(part.ops, full)


def part_views(buf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Byte views of ``buf`` for each part, at the offsets :func:`pack_layout` gives."""
    layout = pack_layout(sizes)
    return [buf[off : off + n] for n, off in zip(sizes, layout.offsets, strict=True)]
