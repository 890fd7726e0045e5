"""The batched copy kernel (Triton): a whole copy plan, thousands of 1-D and 2-D copies, in a few launches.

The copy engine runs a 2-D copy row by row, and rows of a few KB (a row-parallel matrix split in two: 1.5 KB rows
at a 3 KB pitch) run far below the device's copy rate; every copy is also one driver call from Python. Here SMs
do the copying: :func:`kvmove.transport.tiling.plan_tiles` cuts the plan into tiles (one program each) grouped
into a launch per (alignment, row width) class, and each program loads its tile's descriptor and moves it in
``rows x cols`` blocks with vectorized loads. Offsets are relative to one base pointer (``base``: any device
tensor; unified addressing lets a program read a peer GPU's memory as well, where peer access is enabled), so one
launch serves every read of a batch, whatever buffers they touch. Descriptor tables are uploaded once per plan
(:class:`TritonCopies` is built at warm start) and each run is just the launches.

Imported lazily (kvmove works without triton). ``kvmove check copy`` runs a micro-check on a
GPU: a pp=2 -> tp=2 shaped plan (row-parallel halves of MoE down projections) by the driver's copy engine and by
this kernel, each checked equal to torch's copy, with their GB/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmove.transport.tiling import Launch, TilePlan

ELEM_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}
NUM_WARPS = 4


@triton.jit
def _copy_tiles(base, tiles, ALIGN: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Program ``i`` moves tile ``i``: ``height`` rows of ``width`` elements from ``base + src + r * src_pitch`` to
    ``base + dst + r * dst_pitch`` (every quantity a multiple of ``ALIGN`` elements but the height)."""
    t = tl.program_id(0).to(tl.int64) * 6
    s = tl.multiple_of(tl.load(tiles + t), ALIGN)
    d = tl.multiple_of(tl.load(tiles + t + 1), ALIGN)
    w = tl.multiple_of(tl.load(tiles + t + 2), ALIGN)
    h = tl.load(tiles + t + 3)
    sp = tl.multiple_of(tl.load(tiles + t + 4), ALIGN)
    dp = tl.multiple_of(tl.load(tiles + t + 5), ALIGN)
    r = tl.arange(0, ROWS).to(tl.int64)
    c = tl.arange(0, COLS).to(tl.int64)
    # NOTE: while loops over block counters, not range(): Triton's CPU interpreter cannot take a loaded scalar as a
    # range bound; offsets are counter * constant so the compiler still knows their alignment (vector loads)
    i = h * 0
    while i * ROWS < h:
        rows = i * ROWS + r
        j = w * 0
        while j * COLS < w:
            cols = j * COLS + c
            mask = (rows < h)[:, None] & (cols < w)[None, :]
            x = tl.load(base + s + rows[:, None] * sp + cols[None, :], mask=mask)
            tl.store(base + d + rows[:, None] * dp + cols[None, :], x, mask=mask)
            j += 1
        i += 1


class TritonTiles:
    """A tile plan ready to launch from ``base``: its descriptor tables live on ``base``'s device."""

    def __init__(self, tiles: TilePlan, base: torch.Tensor) -> None:
        if base.data_ptr() % 16:
            raise ValueError("the copy kernel's base pointer must be 16-byte aligned")
        self.base = base
        self.launches = [
            (
                base.view(torch.uint8)[:16].view(ELEM_DTYPES[launch.elem]),
                torch.from_numpy(launch.tiles.reshape(-1).copy()).to(base.device),
                launch,
            )
            for launch in tiles.launches
            if len(launch.tiles)
        ]

    def run(self) -> None:
        """Enqueue every launch on the current stream of ``base``'s device."""
        for ptr, table, launch in self.launches:
            _launch(ptr, table, launch, len(launch.tiles))

    def warm(self) -> None:
        """Compile every launch's kernel now (at warm start, not in the first sync): one program over an empty
        tile each, which moves nothing."""
        empty = torch.zeros(6, dtype=torch.int64, device=self.base.device)
        for ptr, _, launch in self.launches:
            _launch(ptr, empty, launch, 1)


def _launch(ptr: torch.Tensor, table: torch.Tensor, launch: Launch, programs: int) -> None:
    _copy_tiles[(programs,)](ptr, table, ALIGN=launch.align, ROWS=launch.rows, COLS=launch.cols, num_warps=NUM_WARPS)
