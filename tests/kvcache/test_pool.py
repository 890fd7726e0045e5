import pytest
import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache import KVGeometry, KVPool, PageAllocator, pages_to_slots, slots_to_pages


def geometry(page_size: int = 4, dtype: torch.dtype = torch.float32) -> KVGeometry:
    return KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=page_size, dtype=dtype)


@pytest.mark.parametrize("num_pages", [1, 7, 64])
def test_alloc_free_roundtrip_keeps_counts(num_pages: int) -> None:
    alloc = PageAllocator(num_pages)
    first = alloc.alloc(num_pages // 2)
    second = alloc.alloc(num_pages - num_pages // 2)
    assert sorted(torch.cat([first, second]).tolist()) == list(range(num_pages))
    assert alloc.free_pages == 0 and alloc.used_pages == num_pages
    assert not alloc.can_alloc(1)
    alloc.check_integrity()
    alloc.free(first)
    assert alloc.free_pages == first.numel()
    alloc.check_integrity()
    alloc.free(second.tolist())
    assert alloc.used_pages == 0
    alloc.check_integrity()


def test_alloc_beyond_capacity_raises() -> None:
    pool = KVPool(geometry(), num_pages=3)
    assert pool.can_alloc(3) and not pool.can_alloc(4) and not pool.can_alloc(-1)
    with pytest.raises(KVCacheError, match="cannot allocate 4 pages"):
        pool.alloc(4)
    pool.check_integrity()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([0, 0], "duplicates"),
        ([5], "out of range"),
        ([-1], "out of range"),
        (torch.tensor([1.0]), "integers"),
        (torch.tensor([[0]]), "1-D"),
    ],
)
def test_free_rejects_bad_ids_and_changes_nothing(bad: object, message: str) -> None:
    pool = KVPool(geometry(), num_pages=5)
    pages = pool.alloc(2)
    with pytest.raises(KVCacheError, match=message):
        pool.free(bad)  # type: ignore[arg-type]
    assert pool.used_pages == 2 and pool.is_allocated(pages)
    pool.check_integrity()


def test_double_free_raises_and_is_all_or_nothing() -> None:
    pool = KVPool(geometry(), num_pages=4)
    a, b = pool.alloc(1), pool.alloc(1)
    pool.free(a)
    with pytest.raises(KVCacheError, match="not allocated"):
        pool.free(torch.cat([b, a]))
    assert pool.is_allocated(b) and pool.used_pages == 1
    pool.check_integrity()


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_token_slots_cover_pages(page_size: int) -> None:
    pool = KVPool(geometry(page_size), num_pages=4)
    slots = pool.token_slots(torch.tensor([2, 0]))
    assert slots.tolist() == [2 * page_size + i for i in range(page_size)] + list(range(page_size))
    assert slots_to_pages(slots, page_size).tolist() == [2, 0]


@pytest.mark.parametrize("slots", [[0, 1, 2], [1, 2, 3, 4], [0, 2, 1, 3], [-4, -3, -2, -1]])
def test_slots_to_pages_rejects_partial_pages(slots: list[int]) -> None:
    with pytest.raises(KVCacheError):
        slots_to_pages(slots, 4)


def test_write_read_roundtrip() -> None:
    g = geometry(page_size=4)
    pool = KVPool(g, num_pages=4)
    pages = pool.alloc(2)
    slots = pool.token_slots(pages)
    k = torch.randn(slots.numel(), *g.token_shape)
    v = torch.randn(slots.numel(), *g.token_shape)
    pool.write(1, slots, k, v)
    got = pool.read(1, slots)
    assert torch.equal(got.k, k) and torch.equal(got.v, v)
    assert torch.count_nonzero(pool.read(0, slots).k) == 0, "another layer was written"
    view = pool.page_views()[g.num_layers + 1]  # V of layer 1
    assert torch.equal(view[pages].reshape(-1, *g.token_shape), v)
    pool.check_integrity()


@pytest.mark.parametrize(
    ("k_shape", "dtype", "message"),
    [
        ((4, 2, 8), torch.bfloat16, "dtype"),
        ((3, 2, 8), torch.float32, "shape"),
        ((4, 2, 4), torch.float32, "shape"),
    ],
)
def test_write_rejects_wrong_dtype_or_shape(k_shape: tuple[int, ...], dtype: torch.dtype, message: str) -> None:
    pool = KVPool(geometry(page_size=4), num_pages=2)
    slots = pool.token_slots(pool.alloc(1))
    with pytest.raises(KVCacheError, match=message):
        pool.write(0, slots, torch.ones(k_shape, dtype=dtype), torch.ones(k_shape, dtype=dtype))
    assert torch.count_nonzero(pool.k_buffer(0)) == 0


def test_write_outside_allocated_pages_or_layers_raises() -> None:
    g = geometry(page_size=4)
    pool = KVPool(g, num_pages=2)
    pool.alloc(1)
    kv = torch.ones(4, *g.token_shape)
    with pytest.raises(KVCacheError, match="not allocated"):
        pool.write(0, pool.token_slots([1]), kv, kv)
    with pytest.raises(KVCacheError, match="out of range"):
        pool.write(0, torch.arange(8, 12), kv, kv)
    with pytest.raises(KVCacheError, match="layer 2"):
        pool.write(2, pool.token_slots([0]), kv, kv)
    with pytest.raises(KVCacheError, match="1-D integer"):
        pool.read(0, torch.zeros(4))
    assert torch.count_nonzero(pool.k_buffer(0)) == 0


def test_geometry_validation_and_compatibility() -> None:
    with pytest.raises(KVCacheError, match="page_size"):
        KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=0)
    a, b = geometry(page_size=4), geometry(page_size=8, dtype=torch.bfloat16)
    with pytest.raises(KVCacheError, match=r"page_size 4 != 8.*dtype"):
        a.check_compatible(b)
    a.check_compatible(geometry(page_size=4))
    assert a.page_bytes == 4 * 2 * 8 * 4 and a.num_buffers == 4


def test_check_integrity_detects_corruption() -> None:
    pool = KVPool(geometry(), num_pages=4)
    pool.alloc(2)
    pool._alloc._free = torch.cat([pool._alloc._free, torch.tensor([0])])  # an allocated id leaks into the free list
    with pytest.raises(KVCacheError):
        pool.check_integrity()


def test_pages_to_slots_on_empty() -> None:
    assert pages_to_slots(torch.empty(0, dtype=torch.int64), 4).numel() == 0
