"""Host KV pool: the pages a transport moves between workers, and write-back/load-back to the device pool."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache.allocator import PageAllocator, Paged, PageIds, as_page_ids, pages_to_slots
from kvmove.kvcache.checksum import pages_digest
from kvmove.kvcache.geometry import KVGeometry
from kvmove.kvcache.pool import KVPool


class PagePair(NamedTuple):
    """Device pages and the host pages they pair with, one for one."""

    device: torch.Tensor
    host: torch.Tensor


class HostKVPool(Paged):
    """Paged KV cache in host memory with the device pool's geometry.

    Layout: ``2 * num_layers`` contiguous buffers (K of every layer, then V of every layer, the order of SGLang's
    ``kv_data_ptrs``), each ``[num_pages, page_size, num_kv_heads, head_dim]``. Page ``p`` of buffer ``i`` starts
    at byte ``data_ptrs()[i] + p * item_lens()[i]``, so a peer that knows the pointers, item lengths and page ids
    can move pages by raw byte ranges. A transport registers ``buffers()`` once.

    Contract: every page argument is validated against this pool's allocator (and the device pool's for
    write-back/load-back): nothing is ever read from or written to a free page; misuse raises KVCacheError and
    changes nothing.
    """

    def __init__(self, geometry: KVGeometry, num_pages: int, pin_memory: bool = False) -> None:
        self.geometry = geometry
        self._alloc = PageAllocator(num_pages)
        shape = (num_pages, geometry.page_size, *geometry.token_shape)
        self._buffers = [
            torch.zeros(shape, dtype=geometry.dtype, pin_memory=pin_memory) for _ in range(geometry.num_buffers)
        ]

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    def token_slots(self, pages: PageIds) -> torch.Tensor:
        """Token slots of ``pages`` (SGLang's host ``kv_indices`` are token slots, not page ids)."""
        return pages_to_slots(as_page_ids(pages, self.num_pages), self.page_size)

    def buffers(self) -> list[torch.Tensor]:
        """The ``2 * num_layers`` layer buffers, K layers then V layers, for one-time transport registration."""
        return list(self._buffers)

    def data_ptrs(self) -> list[int]:
        """Address of each layer buffer (``host_kv_data_ptrs``)."""
        return [b.data_ptr() for b in self._buffers]

    def item_lens(self) -> list[int]:
        """Bytes of one page of each layer buffer (``host_kv_item_lens``)."""
        return [self.geometry.page_bytes] * self.geometry.num_buffers

    def buffer_lens(self) -> list[int]:
        """Total bytes of each layer buffer (what a transport registers)."""
        return [b.nbytes for b in self._buffers]

    def write_back(self, device_pool: KVPool, device_pages: PageIds, host_pages: PageIds) -> None:
        """Copy ``device_pages[i]`` of ``device_pool`` into ``host_pages[i]`` of this pool, every layer buffer."""
        dev, host = self._pair(device_pool, device_pages, host_pages)
        runs = _runs(dev, host)
        for src, dst in zip(device_pool.page_views(), self._buffers, strict=True):
            if runs is None:
                dst[host] = src[dev.to(src.device)].to("cpu")
                continue
            for d, h, n in runs:  # NOTE: whole runs straight into (pinned) host memory: one DMA each
                dst[h : h + n].copy_(src[d : d + n], non_blocking=True)
        _synchronize(device_pool)

    def load_back(self, device_pool: KVPool, device_pages: PageIds, host_pages: PageIds) -> None:
        """Copy ``host_pages[i]`` of this pool into ``device_pages[i]`` of ``device_pool``, every layer buffer."""
        dev, host = self._pair(device_pool, device_pages, host_pages)
        runs = _runs(dev, host)
        for dst, src in zip(device_pool.page_views(), self._buffers, strict=True):
            if runs is None:
                dst[dev.to(dst.device)] = src[host].to(dst.device)
                continue
            for d, h, n in runs:
                dst[d : d + n].copy_(src[h : h + n], non_blocking=True)
        _synchronize(device_pool)

    def read_pages(self, pages: PageIds) -> torch.Tensor:
        """Bytes of ``pages`` as a uint8 tensor ``[2 * num_layers, len(pages), page_bytes]`` (a copy)."""
        idx = self._allocated(pages)
        return torch.stack([self._bytes(b)[idx] for b in self._buffers])

    def write_pages(self, pages: PageIds, data: torch.Tensor) -> None:
        """Store ``data`` (as returned by ``read_pages`` of a pool with the same geometry) into ``pages``."""
        idx = self._allocated(pages)
        want = (self.geometry.num_buffers, idx.numel(), self.geometry.page_bytes)
        if data.dtype != torch.uint8 or tuple(data.shape) != want:
            raise KVCacheError(f"page data: {data.dtype} {tuple(data.shape)}, expected torch.uint8 {want}")
        for i, b in enumerate(self._buffers):
            self._bytes(b)[idx] = data[i].to("cpu")

    def digest(self, pages: PageIds) -> str:
        """Checksum of the bytes of allocated ``pages`` (``kvcache.checksum``; equal to the device pool's digest
        of pages holding the same K/V)."""
        return pages_digest([(self._buffers, self._allocated(pages))])

    def scrub(self, pages: PageIds) -> None:
        """Zero allocated ``pages`` in every buffer (before they are freed, so nothing of them can be read later)."""
        idx = self._allocated(pages)
        for b in self._buffers:
            b[idx] = 0

    def check_integrity(self) -> None:
        """Allocator invariants hold and every buffer keeps its shape, dtype and address."""
        self._alloc.check_integrity()
        shape = (self.num_pages, self.page_size, *self.geometry.token_shape)
        for b in self._buffers:
            if tuple(b.shape) != shape or b.dtype != self.geometry.dtype or not b.is_contiguous():
                raise KVCacheError(f"host pool buffer changed: {tuple(b.shape)} {b.dtype}")

    def _bytes(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(self.num_pages, -1).view(torch.uint8)

    def _allocated(self, pages: PageIds, what: str = "host pages") -> torch.Tensor:
        idx = as_page_ids(pages, self.num_pages, what)
        self._alloc.check_allocated(idx, what)
        return idx

    def _pair(self, device_pool: KVPool, device_pages: PageIds, host_pages: PageIds) -> PagePair:
        self.geometry.check_compatible(device_pool.geometry, "the device pool")
        host = self._allocated(host_pages)
        dev = as_page_ids(device_pages, device_pool.num_pages, "device pages")
        if dev.numel() != host.numel():
            raise KVCacheError(f"{dev.numel()} device pages but {host.numel()} host pages")
        if not device_pool.is_allocated(dev):
            raise KVCacheError("device pages not allocated")
        return PagePair(dev, host)


def _runs(dev: torch.Tensor, host: torch.Tensor, max_runs: int = 64) -> list[tuple[int, int, int]] | None:
    """(device start, host start, length) of runs where both page lists advance by one; None if too fragmented."""
    d, h = dev.tolist(), host.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, (a, b) in enumerate(zip(d, h, strict=True)):
        if i and runs and a == d[i - 1] + 1 and b == h[i - 1] + 1:
            s_d, s_h, n = runs[-1]
            runs[-1] = (s_d, s_h, n + 1)
        else:
            runs.append((a, b, 1))
    return runs if len(runs) <= max_runs else None


def _synchronize(pool: KVPool) -> None:
    device = pool.page_views()[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
