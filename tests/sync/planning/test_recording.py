from __future__ import annotations

import pytest
import torch
from torch import nn

from kvmove.errors import PlanError, UnrecordableOpError
from kvmove.models.tensors import TensorMeta
from kvmove.sync.planning.recording import RecordingSink, RecordingTensor, dry_run, replay


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(6, 4, device="meta"), requires_grad=False)


def _rec(shape=(8, 6)) -> tuple[RecordingTensor, RecordingSink, _Holder]:
    holder = _Holder()
    sink = RecordingSink(holder)
    return RecordingTensor.of(TensorMeta("x.weight", shape), sink), sink, holder


CHAINS = [
    lambda t: t.narrow(0, 2, 6).t().contiguous().t(),
    lambda t: t.chunk(2, dim=0)[1].transpose(0, 1)[1:5, :],
    lambda t: t.view(4, 2, 6).permute(1, 0, 2)[0],
    lambda t: t.split([3, 5])[1].unsqueeze(0).squeeze(0).flatten(),
    lambda t: t.unbind(1)[4].reshape(2, 4),
    lambda t: t[..., 1::2].select(0, 3),
    lambda t: torch.narrow(t, 1, 1, 3).T,
]


@pytest.mark.parametrize("chain", CHAINS)
def test_recorded_chain_replays_to_the_same_tensor(chain) -> None:
    rec, _, _ = _rec()
    out = chain(rec)
    assert isinstance(out, RecordingTensor)
    real = torch.randn(8, 6)
    assert torch.equal(replay(out.chain, real), chain(real))
    assert tuple(out.shape) == tuple(chain(real).shape)


def test_copy_is_captured_with_destination_geometry() -> None:
    rec, sink, holder = _rec()
    holder.w.data.narrow(0, 2, 4).copy_(rec.narrow(0, 4, 4).narrow(1, 0, 4))
    (cap,) = sink.captures
    assert cap.param == "w" and cap.source == "x.weight"
    assert cap.dst.offset == 8 and cap.dst.shape == (4, 4) and cap.dst.stride == (4, 1)
    assert cap.src is not None and cap.src.offset == 24 and cap.src.stride == (6, 1)
    assert [op.name for op in cap.ops] == ["narrow", "narrow"]


@pytest.mark.parametrize(
    ("op", "name"),
    [
        (lambda t: t + 1, "add"),
        (lambda t: t * 2, "mul"),
        (lambda t: t.to(torch.float32), "to"),
        (lambda t: t.float(), "float"),
        (lambda t: t.sum(), "sum"),
        (lambda t: t.item(), "item"),
        (lambda t: t[torch.tensor([0, 1])], "__getitem__"),
        (lambda t: t[t > 0], "gt"),
        (lambda t: t.clone(), "clone"),
        (lambda t: t.expand(2, 8, 6), "expand"),
    ],
)
def test_ops_that_need_values_fail_naming_the_op(op, name: str) -> None:
    rec, _, _ = _rec()
    with pytest.raises(UnrecordableOpError, match=f"'{name}'.*x.weight"):
        op(rec)


def test_broadcasting_copy_and_foreign_destination_rejected() -> None:
    rec, _, holder = _rec((4,))
    with pytest.raises(PlanError, match="broadcast"):
        holder.w.data.copy_(rec)
    rec2, _, _ = _rec((6, 4))
    with pytest.raises(PlanError, match="not a parameter"):
        torch.empty(6, 4, device="meta").copy_(rec2)
    with pytest.raises(UnrecordableOpError, match="copy_ into recording"):
        rec2.copy_(torch.zeros(6, 4))


def test_dry_run_of_a_loader_that_peeks_at_values_fails() -> None:
    holder = _Holder()

    def bad_loader(weights):
        for _, w in weights:
            holder.w.data.copy_(w * 0.5)

    with pytest.raises(UnrecordableOpError, match="'mul'"):
        dry_run(holder, [TensorMeta("x.weight", (6, 4))], bad_loader)


def test_a_copying_reshape_is_refined_into_one_strided_view() -> None:
    from kvmove.sync.planning.recording import Op, StridedView, refine

    # q rows out of a [q, q, k, v] x 2 interleave (rows of 4): view into groups, narrow, reshape (copies)
    chain = (Op("view", (2, 4, 4)), Op("__getitem__", ((slice(None), slice(0, 2)),)), Op("reshape", (4, 4)))
    src, dst = refine((8, 4), chain, StridedView(0, (4, 4), (4, 1)))
    assert src == StridedView(0, (2, 2, 4), (16, 4, 1)) and dst == StridedView(0, (2, 2, 4), (8, 4, 1))
    x = torch.arange(32).view(8, 4)
    assert torch.equal(src.apply(x).reshape(4, 4), x.view(2, 4, 4)[:, :2].reshape(4, 4))
    # three of those rows across the group boundary (rows 1, 4, 5 of the tensor): no strided view
    assert refine((8, 4), (*chain, Op("narrow", (0, 1, 3))), StridedView(0, (3, 4), (4, 1))) is None
    # a transpose flattened by a copying reshape is one
    flat = refine((6,), (Op("view", (3, 2)), Op("t"), Op("reshape", (6,))), StridedView(0, (6,), (1,)))
    assert flat is not None and flat[0] == StridedView(0, (2, 3), (1, 2))
