"""The batched copy kernel on CPU, run by Triton's interpreter: every plan's bytes equal ``copy_views``'s.

Runs where triton is installed and no GPU is (``pip install triton``; not part of kvmove's dev environment, so CI
runs the kernel's semantics through ``tiling.run_tiles_numpy`` in test_tiling.py instead); on a GPU machine
test_cuda_copies.py runs the compiled kernel.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from copy_cases import CASES, DST_SIZE, SRC_SIZE

if torch.cuda.is_available():
    pytest.skip("a GPU runs the compiled kernel (test_cuda_copies.py)", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (its CPU interpreter runs this test)")

from kvmove.transport.copies import copy_views, plan_copies, shifted
from kvmove.transport.tiling import plan_tiles
from kvmove.transport.triton_copy import TritonTiles


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_equals_copy_views(case: str) -> None:
    plan = plan_copies(CASES[case]())
    mem = torch.zeros(64 + SRC_SIZE + DST_SIZE, dtype=torch.uint8)
    src, dst = mem[64 : 64 + SRC_SIZE], mem[64 + SRC_SIZE :]
    src.copy_(torch.from_numpy(np.random.default_rng(1).integers(0, 256, SRC_SIZE, dtype=np.uint8)))
    want = torch.zeros(DST_SIZE, dtype=torch.uint8)
    copy_views(src, want, plan)
    tiles = plan_tiles(shifted(plan, 64, 64 + SRC_SIZE), tile_bytes=8192, block_bytes=2048)
    TritonTiles(tiles, mem[:16]).run()
    assert torch.equal(dst, want)
