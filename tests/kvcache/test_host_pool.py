import pytest
import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache import HostKVPool, KVGeometry, KVPool


def geometry(page_size: int = 4, dtype: torch.dtype = torch.bfloat16, num_layers: int = 3) -> KVGeometry:
    return KVGeometry(num_layers=num_layers, num_kv_heads=2, head_dim=8, page_size=page_size, dtype=dtype)


def filled_device_pool(g: KVGeometry, num_pages: int, used: int, seed: int = 0) -> tuple[KVPool, torch.Tensor]:
    pool = KVPool(g, num_pages)
    pages = pool.alloc(used)
    slots = pool.token_slots(pages)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(g.num_layers):
        k = torch.randn(slots.numel(), *g.token_shape, generator=gen).to(g.dtype)
        v = torch.randn(slots.numel(), *g.token_shape, generator=gen).to(g.dtype)
        pool.write(layer, slots, k, v)
    return pool, pages


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_registration_info_matches_buffers(page_size: int) -> None:
    g = geometry(page_size)
    host = HostKVPool(g, num_pages=5)
    ptrs, lens = host.data_ptrs(), host.item_lens()
    assert len(ptrs) == len(lens) == len(host.buffers()) == 2 * g.num_layers
    assert len(set(ptrs)) == len(ptrs)
    assert lens == [page_size * 2 * 8 * 2] * len(lens)
    assert host.buffer_lens() == [5 * lens[0]] * len(lens)
    for ptr, item, buf in zip(ptrs, lens, host.buffers(), strict=True):
        assert buf.is_contiguous() and buf.data_ptr() == ptr
        assert buf[3].data_ptr() == ptr + 3 * item, "page p must start at ptr + p * item_len"
    host.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_back_then_load_back_restores_kv(page_size: int) -> None:
    g = geometry(page_size)
    device, dev_pages = filled_device_pool(g, num_pages=8, used=3)
    expected = [v[dev_pages].clone() for v in device.page_views()]
    host = HostKVPool(g, num_pages=6)
    host.alloc(2)  # so host page ids differ from device page ids
    host_pages = host.alloc(3).flip(0)
    host.write_back(device, dev_pages, host_pages)

    fresh = KVPool(g, num_pages=8)
    fresh.alloc(4)
    new_pages = fresh.alloc(3)
    host.load_back(fresh, new_pages, host_pages)
    for got, want in zip(fresh.page_views(), expected, strict=True):
        assert torch.equal(got[new_pages], want)
    host.check_integrity()
    device.check_integrity()
    fresh.check_integrity()


def test_pages_move_between_host_pools_as_bytes() -> None:
    g = geometry(page_size=4)
    device, dev_pages = filled_device_pool(g, num_pages=4, used=2, seed=1)
    src, dst = HostKVPool(g, num_pages=4), HostKVPool(g, num_pages=4)
    src_pages = src.alloc(2)
    src.write_back(device, dev_pages, src_pages)
    dst.alloc(1)
    dst_pages = dst.alloc(2)

    data = src.read_pages(src_pages)
    assert data.dtype == torch.uint8 and tuple(data.shape) == (2 * g.num_layers, 2, g.page_bytes)
    dst.write_pages(dst_pages, data)
    assert torch.equal(dst.read_pages(dst_pages), data)
    for a, b in zip(src.buffers(), dst.buffers(), strict=True):
        assert torch.equal(a[src_pages], b[dst_pages])
    src.check_integrity()
    dst.check_integrity()


def test_write_pages_never_touches_unallocated_pages() -> None:
    g = geometry(page_size=2)
    host = HostKVPool(g, num_pages=4)
    mine = host.alloc(1)
    data = torch.full((g.num_buffers, 1, g.page_bytes), 7, dtype=torch.uint8)
    with pytest.raises(KVCacheError, match="not allocated"):
        host.write_pages([3], data)
    with pytest.raises(KVCacheError, match=r"expected torch\.uint8"):
        host.write_pages(mine, data.to(torch.int16))
    with pytest.raises(KVCacheError, match=r"expected torch\.uint8"):
        host.write_pages(mine, data[:, :, :-1])
    with pytest.raises(KVCacheError, match="out of range"):
        host.read_pages([4])
    assert all(torch.count_nonzero(b) == 0 for b in host.buffers())


@pytest.mark.parametrize(
    "other",
    [geometry(page_size=8), geometry(dtype=torch.float16), geometry(num_layers=2)],
    ids=["page_size", "dtype", "layers"],
)
def test_write_back_rejects_geometry_mismatch(other: KVGeometry) -> None:
    device, pages = filled_device_pool(other, num_pages=2, used=1)
    host = HostKVPool(geometry(), num_pages=2)
    host_pages = host.alloc(1)
    with pytest.raises(KVCacheError, match="geometry mismatch"):
        host.write_back(device, pages, host_pages)
    with pytest.raises(KVCacheError, match="geometry mismatch"):
        host.load_back(device, pages, host_pages)


def test_write_back_checks_both_allocators_and_lengths() -> None:
    g = geometry()
    device, dev_pages = filled_device_pool(g, num_pages=4, used=2)
    host = HostKVPool(g, num_pages=4)
    host_pages = host.alloc(2)
    with pytest.raises(KVCacheError, match="2 device pages but 1 host pages"):
        host.write_back(device, dev_pages, host_pages[:1])
    with pytest.raises(KVCacheError, match="device pages not allocated"):
        host.write_back(device, [2, 3], host_pages)
    with pytest.raises(KVCacheError, match="host pages not allocated"):
        host.write_back(device, dev_pages, [2, 3])
    assert all(torch.count_nonzero(b) == 0 for b in host.buffers())


def test_host_allocator_rejects_double_free() -> None:
    host = HostKVPool(geometry(), num_pages=3)
    pages = host.alloc(2)
    host.free(pages)
    with pytest.raises(KVCacheError, match="not allocated"):
        host.free(pages[:1])
    assert host.free_pages == 3
    host.check_integrity()


def test_token_slots_are_the_wire_kv_indices() -> None:
    host = HostKVPool(geometry(page_size=4), num_pages=4)
    assert host.token_slots([1, 3]).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
