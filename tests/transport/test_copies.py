"""Copy plans (pure): spans fold into 2-D copies that move exactly the spans' bytes; the torch executor (the CPU
path of every CUDA transport) and the local transport's batched reads copy them bit-exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmove.transport.base import Read
from kvmove.transport.copies import HEIGHT, MAX_HEIGHT, copy_views, expand, plan_copies
from kvmove.transport.local import LocalTransport


def _column_block(rows: int, cols: int, start: int, width: int, itemsize: int = 2) -> np.ndarray:
    """Spans of columns [start, start+width) of a row-major (rows, cols) matrix, packed densely on the reader."""
    r = np.arange(rows, dtype=np.int64)
    return np.stack(
        [(r * cols + start) * itemsize, r * width * itemsize, np.full(rows, width * itemsize)], axis=1
    ).astype(np.int64)


def test_a_column_block_is_one_2d_copy() -> None:
    spans = _column_block(rows=1024, cols=512, start=256, width=256)
    plan = plan_copies(spans)
    assert plan.ncopies == 1
    assert plan.copies.tolist() == [[512, 0, 512, 1024, 1024, 512]]
    assert plan.nbytes == int(spans[:, 2].sum())
    np.testing.assert_array_equal(expand(plan), spans)


def test_long_runs_split_at_the_height_limit() -> None:
    spans = _column_block(rows=MAX_HEIGHT + 10, cols=4, start=0, width=2)
    plan = plan_copies(spans)
    assert plan.copies[:, HEIGHT].tolist() == [MAX_HEIGHT, 10]
    np.testing.assert_array_equal(expand(plan), spans)


def test_irregular_spans_stay_1d_and_mixed_runs_fold_only_where_regular() -> None:
    irregular = np.array([[0, 0, 10], [100, 10, 7], [300, 17, 3]], dtype=np.int64)
    plan = plan_copies(irregular)
    assert plan.ncopies == 3 and (plan.copies[:, HEIGHT] == 1).all()
    mixed = np.concatenate([irregular, _column_block(8, 64, 0, 16) + np.array([1000, 20, 0])])
    plan = plan_copies(mixed)
    assert plan.ncopies == 4 and plan.strided.tolist() == [[1000, 20, 32, 8, 128, 32]]
    np.testing.assert_array_equal(expand(plan), mixed)


def test_overlapping_pitches_never_fold() -> None:
    # a step smaller than the width would make rows of one 2-D copy overlap: kept as 1-D copies
    spans = np.array([[0, 0, 8], [4, 8, 8], [8, 16, 8]], dtype=np.int64)
    assert plan_copies(spans).strided.size == 0


@pytest.mark.parametrize("seed", range(5))
def test_any_spans_round_trip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    parts = []
    src = dst = 0
    for _ in range(20):  # random mixture of regular runs and loose spans, in order, never overlapping
        rows, width = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        pitch = width + int(rng.integers(0, 5))
        r = np.arange(rows, dtype=np.int64)
        parts.append(np.stack([src + r * pitch, dst + r * width, np.full(rows, width)], axis=1))
        src, dst = src + rows * pitch + int(rng.integers(0, 9)), dst + rows * width
    spans = np.concatenate(parts).astype(np.int64)
    plan = plan_copies(spans)
    np.testing.assert_array_equal(expand(plan), spans)
    assert plan.nbytes == int(spans[:, 2].sum()) and plan.ncopies <= len(spans)


def test_empty_spans_make_an_empty_plan() -> None:
    plan = plan_copies(np.zeros((0, 3), dtype=np.int64))
    assert plan.ncopies == 0 and plan.nbytes == 0 and plan.smallest() == 0


def _reference(src: torch.Tensor, dst: torch.Tensor, spans: np.ndarray) -> torch.Tensor:
    out = dst.clone()
    for s, d, n in spans.tolist():
        out[d : d + n] = src[s : s + n]
    return out


def test_torch_executor_copies_bit_exactly() -> None:
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    dst = torch.zeros(1 << 15, dtype=torch.uint8)
    spans = np.concatenate([_column_block(64, 256, 32, 64), np.array([[40000, 20000, 100]], dtype=np.int64)])
    want = _reference(src, dst, spans)
    copy_views(src, dst, plan_copies(spans))
    assert torch.equal(dst, want)


def test_local_transport_reads_a_batch_bit_exactly() -> None:
    server, reader = LocalTransport(), LocalTransport()
    try:
        arena = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
        a, b = torch.zeros(1 << 14, dtype=torch.uint8), torch.zeros(1 << 12, dtype=torch.uint8)
        remote = server.register(arena)
        da, db = reader.register(a), reader.register(b)
        reader.connect(server.endpoint_info())
        sa, sb = _column_block(32, 512, 128, 256), np.array([[7, 0, 4000]], dtype=np.int64)
        batch = [Read(remote, da, sa), Read(remote, db, sb)]
        reader.prepare(batch)
        stats = reader.start_reads(batch).wait()
        assert stats.bytes == int(sa[:, 2].sum() + sb[:, 2].sum())
        assert torch.equal(a, _reference(arena, torch.zeros_like(a), sa))
        assert torch.equal(b, _reference(arena, torch.zeros_like(b), sb))
    finally:
        reader.close()
        server.close()


def test_prepared_reads_are_checked_once_and_frozen() -> None:
    server, reader = LocalTransport(), LocalTransport()
    try:
        remote = server.register(torch.randint(0, 256, (1 << 12,), dtype=torch.uint8))
        local = reader.register(torch.zeros(1 << 12, dtype=torch.uint8))
        reader.connect(server.endpoint_info())
        prepared, fresh = np.array([[0, 0, 64], [64, 64, 64]], dtype=np.int64), np.array([[0, 128, 8]])
        reader.prepare([Read(remote, local, prepared)])
        first = reader._items([Read(remote, local, prepared), Read(remote, local, fresh)])
        again = reader._items([Read(remote, local, prepared), Read(remote, local, fresh)])
        assert first[0].spans is again[0].spans  # checked once, at prepare
        assert first[1].spans is not again[1].spans  # unprepared ranges are checked every time
        assert first[0].spans.tolist() == [[0, 0, 128]]  # coalesced as check_ranges does
        assert reader.is_prepared(first[0].spans) and not reader.is_prepared(first[1].spans)  # what may be cached
        with pytest.raises(ValueError, match="read-only"):
            prepared[0, 2] = 1  # a prepared plan cannot change under the endpoint
        reader.take_executed()
        reader.start_reads([Read(remote, local, prepared)]).wait()
        assert reader.take_executed() == {"views": 128} and reader.take_executed() == {}
    finally:
        reader.close()
        server.close()
