"""KV heads across tensor-parallel ranks: who holds which head, and byte ranges that reshard pages between workers
of different TP exactly (every byte where the target rank's layout wants it, nothing else touched)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache import HeadShard, HeadSlice, HostKVPool, KVGeometry, head_slices, rank_heads, slice_ranges
from kvmove.transport.base import coalesce


def _geo(heads: int, start: int, total: int = 4) -> KVGeometry:
    return KVGeometry(2, heads, 8, 4, torch.float32, start, total)


@pytest.mark.parametrize(
    ("total", "tp", "expected"),
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 2)]),
        (4, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
        (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # more ranks than heads: each head replicated
    ],
)
def test_rank_heads_split_or_replicate(total: int, tp: int, expected: list[tuple[int, int]]) -> None:
    assert [rank_heads(total, tp, r)[:2] for r in range(tp)] == expected
    assert rank_heads(total, tp, 0) == HeadShard(0, expected[0][1], total)


@pytest.mark.parametrize(("total", "tp", "rank"), [(4, 3, 0), (4, 2, 2), (4, 0, 0), (6, 4, 1)])
def test_rank_heads_refuse_splits_that_do_not_tile(total: int, tp: int, rank: int) -> None:
    with pytest.raises(KVCacheError):
        rank_heads(total, tp, rank)


def test_geometry_refuses_heads_outside_the_model() -> None:
    with pytest.raises(KVCacheError, match="outside the model"):
        _geo(2, 3)
    assert _geo(4, 0, 0).model_kv_heads == 4


def test_head_slices_pick_the_source_holding_each_head() -> None:
    two = [_geo(2, 0), _geo(2, 2)]
    assert head_slices(_geo(4, 0), two) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]  # tp=2 -> tp=1
    assert head_slices(_geo(2, 2), [_geo(4, 0)]) == [HeadSlice(0, 2, 0, 2)]  # tp=1 -> tp=2, rank 1
    assert head_slices(_geo(1, 3), two) == [HeadSlice(1, 1, 0, 1)]  # tp=2 -> tp=4, rank 3
    with pytest.raises(KVCacheError, match="no source rank holds KV head 3"):
        head_slices(_geo(4, 0), [_geo(2, 0), _geo(1, 2)])
    with pytest.raises(KVCacheError, match="head_dim 8 != 16"):
        head_slices(_geo(2, 0), [KVGeometry(2, 2, 16, 4, torch.float32, 0, 4)])


def _pool(geo: KVGeometry, seed: int) -> HostKVPool:
    pool = HostKVPool(geo, 6)
    pool.alloc(6)
    gen = torch.Generator().manual_seed(seed)
    for b in pool.buffers():
        b.copy_(torch.randn(b.shape, generator=gen))
    return pool


def _apply(src: HostKVPool, dst: HostKVPool, ranges: np.ndarray) -> None:
    for s, d in zip(src.buffers(), dst.buffers(), strict=True):
        sb, db = s.view(-1).view(torch.uint8), d.view(-1).view(torch.uint8)
        for r, lo, n in coalesce(ranges).tolist():
            db[lo : lo + n] = sb[r : r + n]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (2, 2), (2, 4), (4, 2), (1, 4)])
def test_resharded_pages_hold_exactly_the_heads_of_the_source_pages(src_tp: int, dst_tp: int) -> None:
    full = _pool(_geo(4, 0), seed=1)  # the K/V every worker computes, whole
    sources = []
    for r in range(src_tp):
        shard = rank_heads(4, src_tp, r)
        pool = _pool(_geo(shard.num, shard.start), seed=100 + r)
        for whole, part in zip(full.buffers(), pool.buffers(), strict=True):
            part.copy_(whole[:, :, shard.start : shard.start + shard.num])
        sources.append(pool)
    src_pages, dst_pages = [4, 1, 2], [0, 5, 3]
    for r in range(dst_tp):
        shard = rank_heads(4, dst_tp, r)
        target = _pool(_geo(shard.num, shard.start), seed=200 + r)
        before = [b.clone() for b in target.buffers()]
        for piece in head_slices(target.geometry, [s.geometry for s in sources]):
            src = sources[piece.source]
            _apply(src, target, slice_ranges(src.geometry, target.geometry, src_pages, dst_pages, piece))
        for whole, got, old in zip(full.buffers(), target.buffers(), before, strict=True):
            assert torch.equal(got[dst_pages], whole[src_pages][:, :, shard.start : shard.start + shard.num])
            untouched = [p for p in range(6) if p not in dst_pages]
            assert torch.equal(got[untouched], old[untouched]), "nothing outside the target pages written"


def test_same_heads_move_whole_pages_in_one_range_per_run() -> None:
    geo = _geo(2, 2)
    piece = head_slices(geo, [geo])[0]
    spans = coalesce(slice_ranges(geo, geo, [3, 4, 5], [0, 1, 2], piece))
    assert spans.tolist() == [[3 * geo.page_bytes, 0, 3 * geo.page_bytes]]
