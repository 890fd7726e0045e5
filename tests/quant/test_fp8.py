"""Block-FP8 quantizer: the format, its exact arithmetic, and the block-aligned slicing invariant."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmove.errors import KvmoveError
from kvmove.quant import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    NonFiniteWeightError,
    block_aligned,
    covering_blocks,
    dequantize,
    quantize,
    scale_box,
    scale_shape,
)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (0-d tensors included)."""
    same = a.dtype == b.dtype and a.shape == b.shape
    return same and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def weights(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(4)  # uneven block maxima
    return w.to(dtype)


def reference_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented formula, one block at a time in plain scalar terms."""
    xf = x.float()
    amax = xf.abs().max()
    scale = torch.tensor(1.0) if amax == 0 else amax / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (1, 5), (300, 128), (3, 130, 260)])
def test_matches_the_formula_block_by_block(shape: tuple[int, ...]) -> None:
    x = weights(*shape)
    q = quantize(x)
    assert q.weight.dtype == FP8_DTYPE and q.weight.shape == x.shape
    assert q.scale_inv.dtype == torch.float32 and tuple(q.scale_inv.shape) == scale_shape(shape)
    mats = x.reshape(-1, *shape[-2:])
    for m in range(mats.shape[0]):
        for i in range(q.scale_inv.shape[-2]):
            for j in range(q.scale_inv.shape[-1]):
                rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
                want_q, want_s = reference_block(mats[m, rows, cols])
                assert bits_equal(q.weight.reshape(mats.shape)[m, rows, cols], want_q)
                assert bits_equal(q.scale_inv.reshape(-1, *q.scale_inv.shape[-2:])[m, i, j], want_s)


def test_scale_shape_is_ceil_of_blocks() -> None:
    assert scale_shape((7168, 576)) == (56, 5)
    assert scale_shape((384, 4096, 7168)) == (384, 32, 56)
    with pytest.raises(ValueError, match="matrix"):
        scale_shape((4096,))


def test_block_max_maps_to_448_and_dequantizes_close() -> None:
    x = weights(256, 256, dtype=torch.float32)
    q = quantize(x)
    per_block = q.weight.float().reshape(2, 128, 2, 128).abs().amax(dim=(1, 3))
    assert bool((per_block == FP8_MAX).all())
    err = (dequantize(q) - x).abs()
    assert float(err.max()) <= float(q.scale_inv.max()) * 16  # half an e4m3 step at the top of the range


def test_zero_block_gets_scale_one_and_zeros() -> None:
    x = weights(256, 256)
    x[:128, 128:] = 0
    q = quantize(x)
    assert float(q.scale_inv[0, 1]) == 1.0
    assert bool((q.weight[:128, 128:].float() == 0).all())


def test_strided_input_equals_contiguous() -> None:
    x = weights(384, 512)
    view = x.t()  # non-contiguous
    assert bits_equal(quantize(view).weight, quantize(view.contiguous()).weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes(dtype: torch.dtype) -> None:
    x = weights(130, 260, dtype=dtype)
    q = quantize(x)
    assert bits_equal(q.weight, quantize(x.float()).weight)


@given(
    rows=st.integers(1, 3),
    cols=st.integers(1, 3),
    tail_r=st.integers(0, 127),
    tail_c=st.integers(0, 127),
    data=st.data(),
)
@settings(max_examples=40, deadline=None)
def test_aligned_sub_box_equals_sub_box_of_whole(rows: int, cols: int, tail_r: int, tail_c: int, data) -> None:
    """The core invariant: quantize(x[box]) == quantize(x)[box] for every block-aligned box (scales too)."""
    shape = (rows * BLOCK + tail_r, cols * BLOCK + tail_c)
    x = weights(*shape, seed=rows * 7 + cols)
    whole = quantize(x)
    edges = [[*range(0, n, BLOCK), n] for n in shape]
    r0, r1 = sorted(data.draw(st.lists(st.sampled_from(edges[0]), min_size=2, max_size=2, unique=True)))
    c0, c1 = sorted(data.draw(st.lists(st.sampled_from(edges[1]), min_size=2, max_size=2, unique=True)))
    assert block_aligned((r0, c0), (r1, c1), shape)
    part = quantize(x[r0:r1, c0:c1])
    assert bits_equal(part.weight, whole.weight[r0:r1, c0:c1])
    s = scale_box((r0, c0), (r1, c1))
    assert bits_equal(part.scale_inv, whole.scale_inv[s.start[0] : s.stop[0], s.start[1] : s.stop[1]])


def test_expert_stacks_quantize_per_expert() -> None:
    """Fused w13/w2: blocks never span experts, so any expert range is an aligned box."""
    x = weights(6, 256, 200)
    whole = quantize(x)
    for e in range(6):
        one = quantize(x[e])
        assert bits_equal(one.weight, whole.weight[e]) and bits_equal(one.scale_inv, whole.scale_inv[e])
    assert block_aligned((2, 128, 0), (5, 256, 200), x.shape)
    assert bits_equal(quantize(x[2:5, 128:]).weight, whole.weight[2:5, 128:])


def test_unaligned_box_differs_from_the_whole() -> None:
    """A box that cuts a block quantizes with that block's other elements missing: other scale, other bits."""
    x = weights(256, 256)
    x[10, 100] = 50.0  # the max of block (0, 0), outside the box below
    box = (slice(0, 128), slice(0, 64))
    assert not block_aligned((0, 0), (128, 64), x.shape)
    part, whole = quantize(x[box]), quantize(x)
    assert float(part.scale_inv[0, 0]) < float(whole.scale_inv[0, 0])
    assert not bits_equal(part.weight, whole.weight[box])
    # what a sync must read to quantize that box itself, then cut it out
    cover = covering_blocks((0, 0), (128, 64), x.shape)
    assert cover == ((0, 0), (128, 128))
    again = quantize(x[0:128, 0:128])
    assert bits_equal(again.weight[:, :64], whole.weight[box])


@pytest.mark.parametrize(
    ("start", "stop", "shape", "aligned"),
    [
        ((0, 0), (128, 256), (256, 256), True),
        ((128, 0), (200, 256), (200, 256), True),  # ends at the tensor's edge
        ((128, 0), (200, 256), (300, 256), False),
        ((64, 0), (128, 256), (256, 256), False),
        ((3, 0, 0), (4, 128, 77), (8, 256, 77), True),
    ],
)
def test_block_aligned_cases(start, stop, shape, aligned: bool) -> None:
    assert block_aligned(start, stop, shape) is aligned


def test_covering_and_scale_boxes() -> None:
    assert covering_blocks((5, 130), (140, 300), (200, 310)) == ((0, 128), (200, 310))
    assert scale_box((5, 130), (140, 300)) == ((0, 1), (2, 3))
    assert scale_box((2, 0, 128), (3, 256, 129)) == ((2, 0, 1), (3, 2, 2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(bad: float) -> None:
    x = weights(256, 256)
    x[200, 3] = bad
    with pytest.raises(NonFiniteWeightError, match=r"layers\.0\.x: 1 of its 128x128 blocks"):
        quantize(x, name="layers.0.x")
    assert not bool(torch.isfinite(quantize(x, check_finite=False).scale_inv).all())


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="matrix"):
        quantize(torch.ones(8))
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(KvmoveError, match="unknown quantizer backend 'cuda'"):
        quantize(weights(4, 4), backend="cuda")
    with pytest.raises(KvmoveError, match="triton quantizer runs on CUDA tensors; weight is on cpu"):
        quantize(weights(4, 4), backend="triton")


def test_rounding_is_to_nearest_even() -> None:
    """With a block max of 448 (scale 1), each midpoint of two adjacent e4m3 values goes to the even code."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # every finite non-negative e4m3fn, ascending
    values = codes.view(FP8_DTYPE).float()
    mids = (values[:-1] + values[1:]) / 2
    x = torch.zeros(BLOCK, BLOCK)
    x.view(-1)[: mids.numel()] = mids
    x[-1, -1] = FP8_MAX
    q = quantize(x.to(torch.bfloat16))
    assert float(q.scale_inv) == 1.0
    got = q.weight.view(-1)[: mids.numel()].view(torch.uint8)
    even = torch.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    assert torch.equal(got, even)


def test_check_command_runs_on_cpu(capsys) -> None:
    """``kvmove check quant`` (the GPU check; ``python -m kvmove.quant`` calls it) on a CPU-only machine: torch/cpu
    only, nothing to compare, one JSON line."""
    import json

    from kvmove.quant.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("on a GPU the command compares real backends (tests/quant/test_fp8_gpu.py)")
    assert main() == 0
    (line,) = capsys.readouterr().out.splitlines()
    report = json.loads(line)
    assert report["backends"] == ["torch/cpu"] and report["checks"] == [] and report["throughput"] == []
    assert report["ok"] is True


def test_the_copy_check_refuses_a_machine_without_a_gpu_in_one_line(capsys) -> None:
    from kvmove.cli.main import run

    if torch.cuda.is_available():
        pytest.skip("on a GPU the copy check runs (tests/transport/test_cuda_copies.py)")
    assert run(["check", "copy"]) == 2
    assert capsys.readouterr().err.strip() == "kvmove: error: kvmove check copy needs a CUDA GPU"
