"""Packing: region payloads at 16-byte-aligned offsets of one uint8 slot, identically on both sides.

The trainer packs the regions of one pull, in request order, into a registered slot; the engine carves views
at the same offsets from its receive buffer and copies each into its parameter. Both sides derive the
offsets from the same :func:`pack_layout` of the same request, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.sync.planning.plan import Box, Region, relative_view
from kvmove.sync.planning.recording import StridedView, replay

ALIGN = 16


class SliceSpec(NamedTuple):
    """What a trainer needs to produce one region's payload (sent once, at init; cached by pull id)."""

    hf_name: str
    shape: tuple[int, ...]
    src: StridedView | None
    box: Box
    ops: tuple
    dtype: torch.dtype
    nbytes: int

    @classmethod
    def of(cls, region: Region, tensor_shape: tuple[int, ...]) -> SliceSpec:
        return cls(region.hf_name, tensor_shape, region.src, region.box, region.ops, region.dtype, region.nbytes)


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


def payload(spec: SliceSpec, full: torch.Tensor) -> torch.Tensor:
    """The region's data from the full HF tensor the trainer holds (a strided view, no copy when possible)."""
    if spec.src is not None:
        return relative_view(spec.src, spec.shape, Box.full(spec.shape)).apply(full)
    return replay(spec.ops, full)


def pack(slot: torch.Tensor, specs: Sequence[SliceSpec], tensors: Sequence[torch.Tensor]) -> PackLayout:
    """Copy each spec's payload (from its full tensor) into ``slot``; returns the layout used."""
    layout = pack_layout([s.nbytes for s in specs])
    for spec, full, off in zip(specs, tensors, layout.offsets, strict=True):
        data = payload(spec, full)
        slot[off : off + spec.nbytes].view(spec.dtype).view(data.shape).copy_(data)
    return layout


def unpack(buf: torch.Tensor, regions: Sequence[Region]) -> list[torch.Tensor]:
    """Views of ``buf`` for each region, at the offsets :func:`pack` used."""
    layout = pack_layout([r.nbytes for r in regions])
    return [
        buf[off : off + r.nbytes].view(r.dtype).view(r.dst.shape)
        for r, off in zip(regions, layout.offsets, strict=True)
    ]
