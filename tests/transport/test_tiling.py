"""Tile plans of the batched copy kernel (pure): alignment classes, tiles that cover exactly a plan's bytes, the
kernel's semantics (``run_tiles_numpy``) equal to ``copy_views`` byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from copy_cases import CASES, DST_SIZE, SRC_SIZE

from kvmove.transport.copies import HEIGHT, WIDTH, CopyPlan, copy_views, expand, plan_copies, shifted
from kvmove.transport.tiling import alignments, plan_tiles, run_tiles_numpy

BASE = 64  # where the source region starts in the tests' one memory buffer (the kernel's base is byte 0)


def _memory(seed: int = 0) -> np.ndarray:
    mem = np.zeros(BASE + SRC_SIZE + DST_SIZE, dtype=np.uint8)
    mem[BASE : BASE + SRC_SIZE] = np.random.default_rng(seed).integers(0, 256, SRC_SIZE, dtype=np.uint8)
    return mem


def _expected(mem: np.ndarray, plan: CopyPlan) -> np.ndarray:
    src, dst = torch.from_numpy(mem[BASE : BASE + SRC_SIZE].copy()), torch.zeros(DST_SIZE, dtype=torch.uint8)
    copy_views(src, dst, plan)
    return dst.numpy()


def test_alignment_is_the_largest_power_of_two_dividing_offsets_widths_and_pitches() -> None:
    copies = np.array(
        [
            [0, 32, 64, 1, 64, 64],  # everything a multiple of 32: capped at 16
            [8, 16, 24, 3, 40, 24],  # gcd 8
            [4, 0, 1536, 4096, 3072, 1536],  # offset 4
            [2, 6, 10, 1, 10, 10],  # gcd 2
            [-48, 32, 16, 2, 48, 16],  # negative offsets (below the base) count too
            [3, 0, 16, 1, 16, 16],  # odd offset: bytes
        ],
        dtype=np.int64,
    )
    assert alignments(copies).tolist() == [16, 8, 4, 2, 16, 1]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tile_bytes", [256, 4096, 1 << 20])
def test_tiles_run_as_the_kernel_equal_copy_views(case: str, tile_bytes: int) -> None:
    plan = plan_copies(CASES[case]())
    mem = _memory()
    want = _expected(mem, plan)
    tiles = plan_tiles(shifted(plan, BASE, BASE + SRC_SIZE), tile_bytes=tile_bytes, block_bytes=min(tile_bytes, 1024))
    assert tiles.nbytes == plan.nbytes
    run_tiles_numpy(tiles, mem, 0)
    assert np.array_equal(mem[BASE + SRC_SIZE :], want)


@pytest.mark.parametrize("case", list(CASES))
def test_tiles_cover_each_byte_once_and_respect_their_alignment(case: str) -> None:
    plan = shifted(plan_copies(CASES[case]()), BASE, BASE + SRC_SIZE)
    tiles = plan_tiles(plan, tile_bytes=2048, block_bytes=512)
    spans = []
    for launch in tiles.launches:
        t = launch.tiles
        assert launch.elem in (1, 2, 4) and launch.rows * launch.cols * launch.elem == 512
        assert ((t[:, [0, 1, 2, 4, 5]] % launch.align) == 0).all()  # what the kernel's hints promise
        assert (t[:, WIDTH] * t[:, HEIGHT] * launch.elem <= 2048 + launch.rows * launch.elem).all()
        spans.append(expand(CopyPlan(t * np.array([launch.elem] * 3 + [1] + [launch.elem] * 2))))
    got = np.concatenate(spans)
    want = expand(plan)
    dst = lambda s: np.concatenate([np.arange(d, d + n) for _, d, n in s.tolist()])  # noqa: E731
    assert np.array_equal(np.sort(dst(got)), np.sort(dst(want)))


def test_an_empty_plan_has_no_launches() -> None:
    assert plan_tiles(plan_copies(np.zeros((0, 3), dtype=np.int64))).launches == ()
