"""Kernel launches of a copy plan (pure planning): copies cut into tiles, tiles grouped into a few launches.

A batched copy kernel (``kvmove.transport.triton_copy``) runs a whole :class:`~kvmove.transport.copies.CopyPlan`,
thousands of 1-D and 2-D copies, in a few launches instead of one driver call per copy. It addresses memory as
elements of one integer type from one base pointer, so :func:`plan_tiles` groups the copies by *alignment*: the
largest of 16/8/4/2/1 bytes dividing a copy's source and destination offsets, width and (for a 2-D copy) pitches.
A group's element is that many bytes (at most 4: 16-byte alignment becomes 4-element vectors of int32, which the
compiler turns into 16-byte loads and stores), its offsets are in elements and hinted as multiples of the
alignment so loads vectorize. Copies of one alignment are further grouped by the power of two their rows round up
to (the block a program moves per step is ``rows x cols`` elements, about :data:`BLOCK_BYTES`), and each copy is
cut into *tiles* of about :data:`TILE_BYTES`, one program each, so a 1 GB copy and a row of 1.5 KB both keep every
SM busy. A tile is a copy again: ``(src, dst, width, height, src_pitch, dst_pitch)``, in elements.

:func:`run_tiles_numpy` executes a tile plan on a host byte buffer: the kernel's semantics as a reference that CI
runs without triton (tests compare it with ``copies.copy_views`` byte for byte).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvmove.transport.copies import DST, DST_PITCH, HEIGHT, SRC, SRC_PITCH, WIDTH, CopyPlan

TILE_BYTES = 256 << 10
"""Bytes one program (tile) moves at most: large enough to hide the descriptor load, small enough that a layer's
worth of copies spreads over every SM."""
BLOCK_BYTES = 16 << 10
"""Bytes one program moves per loop step (``rows x cols`` elements)."""
MAX_ALIGN = 16
MAX_ELEM = 4
"""Widest element the kernel loads: int32, four to a 16-byte vector."""


class Launch(NamedTuple):
    """One kernel launch: ``tiles`` ``(t, 6)`` int64 rows in elements of ``elem`` bytes, each offset, width and pitch a
    multiple of ``align`` elements; each program moves one tile in blocks of ``rows x cols`` elements."""

    tiles: np.ndarray
    elem: int
    align: int
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return int((self.tiles[:, WIDTH] * self.tiles[:, HEIGHT]).sum()) * self.elem


class TilePlan(NamedTuple):
    """The launches that together move exactly a copy plan's bytes."""

    launches: tuple[Launch, ...]

    @property
    def nbytes(self) -> int:
        return sum(launch.nbytes for launch in self.launches)

    @property
    def ntiles(self) -> int:
        return sum(len(launch.tiles) for launch in self.launches)


def alignments(copies: np.ndarray) -> np.ndarray:
    """Per copy: the largest of 16/8/4/2/1 bytes dividing its offsets, width and, for 2-D copies, pitches (a 1-D
    copy's pitches are its width). Offsets may be negative (relative to a base inside the address range)."""
    c = np.asarray(copies, dtype=np.int64).reshape(-1, 6)
    g = np.gcd.reduce(c[:, [SRC, DST, WIDTH, SRC_PITCH, DST_PITCH]], axis=1)
    g = np.where(g == 0, MAX_ALIGN, g)
    return np.minimum(g & -g, MAX_ALIGN)


def _pow2_at_least(x: np.ndarray) -> np.ndarray:
    out = np.ones_like(x)
    while (small := out < x).any():
        out = np.where(small, out * 2, out)
    return out


def plan_tiles(plan: CopyPlan, tile_bytes: int = TILE_BYTES, block_bytes: int = BLOCK_BYTES) -> TilePlan:
    """The launches of ``plan`` (offsets relative to one base): copies grouped by alignment and row width, each cut
    into tiles of at most ``tile_bytes`` (a row wider than that is cut into column chunks)."""
    c = plan.copies[(plan.copies[:, WIDTH] > 0) & (plan.copies[:, HEIGHT] > 0)]
    align = alignments(c)
    elem = np.minimum(align, MAX_ELEM)
    block_el = block_bytes // elem
    cols = np.minimum(_pow2_at_least(c[:, WIDTH] // elem), block_el)
    launches = []
    for e, a, k in sorted({(int(e), int(a), int(k)) for e, a, k in zip(elem, align, cols, strict=True)}):
        mine = c[(elem == e) & (align == a) & (cols == k)] // np.array([e, e, e, 1, e, e], dtype=np.int64)
        rows = (block_bytes // e) // k
        tiles = _tiles(mine, tile_bytes // e, k, rows)
        launches.append(Launch(tiles, e, a // e, rows, k))
    return TilePlan(tuple(launches))


def _tiles(c: np.ndarray, tile_el: int, cols: int, rows: int) -> np.ndarray:
    """Copies (in elements) cut into tiles: column chunks of at most ``tile_el`` (a multiple of ``cols``), and row
    blocks of about ``tile_el`` elements (a multiple of ``rows`` rows)."""
    chunk = np.minimum(c[:, WIDTH], max(cols, tile_el // cols * cols))
    nchunks = -(-c[:, WIDTH] // chunk)
    rh = np.maximum(rows, tile_el // chunk // rows * rows)
    nblocks = -(-c[:, HEIGHT] // rh)
    per = nchunks * nblocks
    i = np.repeat(np.arange(len(c)), per)
    k = np.arange(len(i)) - np.repeat(np.cumsum(per) - per, per)  # tile index within its copy
    j, b = k % nchunks[i], k // nchunks[i]  # column chunk, row block
    out = np.empty((len(i), 6), dtype=np.int64)
    col, row = j * chunk[i], b * rh[i]
    out[:, SRC] = c[i, SRC] + row * c[i, SRC_PITCH] + col
    out[:, DST] = c[i, DST] + row * c[i, DST_PITCH] + col
    out[:, WIDTH] = np.minimum(chunk[i], c[i, WIDTH] - col)
    out[:, HEIGHT] = np.minimum(rh[i], c[i, HEIGHT] - row)
    out[:, SRC_PITCH], out[:, DST_PITCH] = c[i, SRC_PITCH], c[i, DST_PITCH]
    return out


def run_tiles_numpy(tiles: TilePlan, memory: np.ndarray, base: int) -> None:
    """Execute ``tiles`` on ``memory`` (a flat uint8 array; element offsets relative to byte ``base`` of it), tile
    after tile, block after block, as the kernel's programs do: the CPU reference of the kernel."""
    for launch in tiles.launches:
        e = launch.elem
        for s, d, w, h, sp, dp in launch.tiles.tolist():
            for r0 in range(0, h, launch.rows):
                for r in range(r0, min(h, r0 + launch.rows)):
                    src, dst = base + (s + r * sp) * e, base + (d + r * dp) * e
                    memory[dst : dst + w * e] = memory[src : src + w * e]
