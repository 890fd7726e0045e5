"""Device KV pool: the paged K/V buffers attention reads and writes, and their page allocator."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache.allocator import PageAllocator, Paged, PageIds, as_page_ids, pages_to_slots
from kvmove.kvcache.checksum import pages_digest
from kvmove.kvcache.geometry import KVGeometry


class KV(NamedTuple):
    """K and V of some tokens in one layer, each ``[tokens, num_kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor


class KVPool(Paged):
    """Paged KV cache on one device (``device`` may be ``"cpu"``).

    Layout: per layer one K and one V buffer of shape ``[num_pages * page_size, num_kv_heads, head_dim]``; page
    ``p`` owns token slots ``p * page_size .. (p + 1) * page_size - 1`` (``token_slots``). Attention indexes the
    buffers by token slot; migration and write-back move whole pages (``page_views``).

    Contract: ``write``/``read`` touch only slots of allocated pages and check dtype, shape and device; every
    misuse raises KVCacheError and changes nothing. The pool does not know who owns a page (a request or the
    radix tree): callers free each page exactly once.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        device: str | torch.device = "cpu",
        allocator: PageAllocator | None = None,
    ) -> None:
        """``allocator``: shared by the pools of a worker's tensor-parallel ranks (one page table, each rank its
        own heads at the same page ids); a fresh one by default."""
        self.geometry = geometry
        self._alloc = allocator or PageAllocator(num_pages)
        if self._alloc.num_pages != num_pages:
            raise KVCacheError(f"shared allocator has {self._alloc.num_pages} pages, the pool {num_pages}")
        shape = (num_pages * geometry.page_size, *geometry.token_shape)
        self._k = [torch.zeros(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.num_layers)]
        self._v = [torch.zeros(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.num_layers)]
        self.device = self._k[0].device

    @property
    def allocator(self) -> PageAllocator:
        """The page allocator (pass it to the pools of the other tensor-parallel ranks of the same worker)."""
        return self._alloc

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    def token_slots(self, pages: PageIds) -> torch.Tensor:
        """Token slots of ``pages``, page by page, on this pool's device."""
        return pages_to_slots(as_page_ids(pages, self.num_pages), self.page_size).to(self.device)

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self._k[self._layer(layer)]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._v[self._layer(layer)]

    def page_views(self) -> list[torch.Tensor]:
        """Every layer buffer viewed as ``[num_pages, page_size, num_kv_heads, head_dim]``: K layers, then V layers."""
        shape = (self.num_pages, self.page_size, *self.geometry.token_shape)
        return [b.view(shape) for b in (*self._k, *self._v)]

    def digest(self, pages: PageIds) -> str:
        """Checksum of the K/V bytes of allocated ``pages`` (``kvcache.checksum``, comparable with the host pool's)."""
        idx = as_page_ids(pages, self.num_pages, "pages")
        if not self.is_allocated(idx):
            raise KVCacheError("digest of pages that are not allocated")
        return pages_digest([(self.page_views(), idx)])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (each ``[len(slots), num_kv_heads, head_dim]``) of ``layer`` at token ``slots``."""
        idx = self._slots(slots)
        want = (idx.numel(), *self.geometry.token_shape)
        for name, t in (("k", k), ("v", v)):
            if t.dtype != self.geometry.dtype:
                raise KVCacheError(f"write {name}: dtype {t.dtype}, pool holds {self.geometry.dtype}")
            if tuple(t.shape) != want:
                raise KVCacheError(f"write {name}: shape {tuple(t.shape)}, expected {want}")
            if t.device != self.device:
                raise KVCacheError(f"write {name}: tensor on {t.device}, pool on {self.device}")
        layer = self._layer(layer)
        self._k[layer][idx] = k
        self._v[layer][idx] = v

    def read(self, layer: int, slots: torch.Tensor) -> KV:
        """K and V of ``layer`` at token ``slots`` (copies)."""
        idx = self._slots(slots)
        layer = self._layer(layer)
        return KV(self._k[layer][idx], self._v[layer][idx])

    def check_integrity(self) -> None:
        """Allocator invariants hold and every buffer keeps its shape, dtype and device."""
        self._alloc.check_integrity()
        shape = (self.num_pages * self.page_size, *self.geometry.token_shape)
        for b in (*self._k, *self._v):
            if tuple(b.shape) != shape or b.dtype != self.geometry.dtype or b.device != self.device:
                raise KVCacheError(f"KV pool buffer changed: {tuple(b.shape)} {b.dtype} {b.device}")

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.geometry.num_layers:
            raise KVCacheError(f"layer {layer} out of range [0, {self.geometry.num_layers})")
        return layer

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() != 1:
            raise KVCacheError(f"token slots must be a 1-D integer tensor, got {slots.dtype} {tuple(slots.shape)}")
        cpu = slots.to(device="cpu", dtype=torch.int64)
        total = self.num_pages * self.page_size
        if cpu.numel() and (int(cpu.min()) < 0 or int(cpu.max()) >= total):
            raise KVCacheError(f"token slots out of range [0, {total})")
        self._alloc.check_allocated(torch.unique(cpu // self.page_size), "pages of token slots")
        return slots.to(device=self.device, dtype=torch.int64)
