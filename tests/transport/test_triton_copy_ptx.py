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


def _ahead_of_time_api():  # type: ignore[no-untyped-def]
    """Triton's ahead-of-time compile API as this test calls it, or a skip naming what differs. Checked by its
    shape before compiling, so that a compile error of the kernel itself fails the test instead of skipping it."""
    import inspect

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this triton has no ahead-of-time compile API: {exc}")
    params = set(inspect.signature(ASTSource).parameters)
    if not {"fn", "signature", "constexprs", "attrs"} <= params:
        pytest.skip(f"this triton's ASTSource takes {sorted(params)}, not fn/signature/constexprs/attrs")
    return ASTSource, GPUTarget


def _memory_ops(elem: str, align: int, rows: int, cols: int) -> set[str]:
    ast_source, gpu_target = _ahead_of_time_api()

    from kvmove.transport.triton_copy import _copy_tiles

    signature = {"base": f"*{elem}", "tiles": "*i64", "ALIGN": "constexpr", "ROWS": "constexpr", "COLS": "constexpr"}
    src = ast_source(
        fn=_copy_tiles,
        signature=signature,
        constexprs={(2,): align, (3,): rows, (4,): cols},
        attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
    )
    ptx = triton.compile(src, target=gpu_target("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))


@pytest.mark.parametrize(
    ("elem", "align", "rows", "cols", "vector"),
    [("i32", 4, 8, 512, "v4.b32"), ("i32", 2, 1, 4096, "v2.b32")],
)
def test_aligned_copies_compile_to_vector_loads(elem: str, align: int, rows: int, cols: int, vector: str) -> None:
    ops = _memory_ops(elem, align, rows, cols)
    assert f"ld.global.{vector}" in ops and f"st.global.{vector}" in ops, ops
