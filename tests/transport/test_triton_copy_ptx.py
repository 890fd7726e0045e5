"""The batched copy kernel compiles for an H100/H200 (sm_90) to 16-byte vector loads and stores where its copies
are 16-byte aligned, 8-byte ones where 8 (the alignment hints survive the loops). Compiling needs triton, no GPU;
skipped without triton (not part of kvmove's dev environment) and under Triton's CPU interpreter."""

from __future__ import annotations

import os
import re

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("Triton's interpreter is on in this process (it compiles nothing)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed")


def _memory_ops(elem: str, align: int, rows: int, cols: int) -> set[str]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvmove.transport.triton_copy import _copy_tiles

    signature = {"base": f"*{elem}", "tiles": "*i64", "ALIGN": "constexpr", "ROWS": "constexpr", "COLS": "constexpr"}
    try:
        src = ASTSource(
            fn=_copy_tiles,
            signature=signature,
            constexprs={(2,): align, (3,): rows, (4,): cols},
            attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
        )
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    except (TypeError, KeyError, AttributeError) as exc:  # another triton's ahead-of-time API (kernel errors raise)
        pytest.skip(f"this triton's ahead-of-time compile API differs: {exc!r}")
    return set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))


@pytest.mark.parametrize(
    ("elem", "align", "rows", "cols", "vector"),
    [("i32", 4, 8, 512, "v4.b32"), ("i32", 2, 1, 4096, "v2.b32")],
)
def test_aligned_copies_compile_to_vector_loads(elem: str, align: int, rows: int, cols: int, vector: str) -> None:
    ops = _memory_ops(elem, align, rows, cols)
    assert f"ld.global.{vector}" in ops and f"st.global.{vector}" in ops, ops
