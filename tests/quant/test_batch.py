"""``quantize_many``: evenly spaced same-shaped views of one storage quantize in one call, bit-identical to
quantizing each alone; anything else falls back to one call per tensor."""

from __future__ import annotations

import pytest
import torch

import kvmove.quant.batch as batch
from kvmove.quant import quantize
from kvmove.quant.batch import quantize_many


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    seen: list[tuple[int, ...]] = []

    def counting(x: torch.Tensor, **kw: object):
        seen.append(tuple(x.shape))
        return quantize(x, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(batch, "quantize", counting)
    return seen


def _same(got, tensors) -> None:
    for q, t in zip(got, tensors, strict=True):
        want = quantize(t)
        assert torch.equal(q.weight.view(torch.uint8), want.weight.view(torch.uint8))
        assert torch.equal(q.scale_inv, want.scale_inv)


def test_experts_back_to_back_quantize_in_one_call(calls: list[tuple[int, ...]]) -> None:
    arena = torch.randn(8 * 256 * 320, dtype=torch.bfloat16)  # 8 experts' (256, 320): the last column block partial
    experts = [arena[i * 256 * 320 : (i + 1) * 256 * 320].view(256, 320) for i in range(8)]
    shuffled = experts[3:] + experts[:3]  # order in the pull need not be storage order
    got = quantize_many(shuffled)
    assert calls == [(8, 256, 320)]
    _same(got, shuffled)


def test_strided_row_slices_of_one_tensor_batch_too(calls: list[tuple[int, ...]]) -> None:
    full = torch.randn(4 * 128, 256, dtype=torch.bfloat16)
    rows = [full[i * 128 : (i + 1) * 128] for i in range(4)]
    got = quantize_many(rows)
    assert calls == [(4, 128, 256)]
    _same(got, rows)


def test_uneven_spacing_overlap_and_other_shapes_fall_back(calls: list[tuple[int, ...]]) -> None:
    base = torch.randn(1024, 256, dtype=torch.bfloat16)
    uneven = [base[0:128], base[128:256], base[384:512]]  # gaps 128, 256: the run breaks at the third
    overlapping = [base[0:256], base[128:384]]  # a step shorter than one tensor's extent
    other = [torch.randn(128, 128, dtype=torch.bfloat16), torch.randn(64, 200, dtype=torch.bfloat16)]
    tensors = uneven + overlapping + other
    got = quantize_many(tensors)
    _same(got, tensors)
    assert sorted(calls) == sorted([(2, 128, 256), (128, 256), (256, 256), (256, 256), (128, 128), (64, 200)])
