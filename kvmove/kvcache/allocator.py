"""Page allocator: which page ids of a pool are free, and the page-id <-> token-slot arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import torch

from kvmove.errors import KVCacheError

PageIds: TypeAlias = torch.Tensor | Sequence[int]
"""Page ids as a 1-D integer tensor or a sequence of ints."""


def as_page_ids(ids: PageIds, num_pages: int, what: str = "page ids") -> torch.Tensor:
    """``ids`` as a 1-D int64 CPU tensor of distinct ids in ``[0, num_pages)``; KVCacheError otherwise."""
    t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(list(ids), dtype=torch.int64)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise KVCacheError(f"{what} must be integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise KVCacheError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    t = t.to(device="cpu", dtype=torch.int64)
    if t.numel() == 0:
        return t
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= num_pages:
        raise KVCacheError(f"{what} out of range [0, {num_pages}): min {lo}, max {hi}")
    if torch.unique(t).numel() != t.numel():
        raise KVCacheError(f"{what} contain duplicates")
    return t


def pages_to_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of ``pages`` in order: page p covers slots ``p * page_size ... p * page_size + page_size - 1``."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages.to(torch.int64).unsqueeze(1) * page_size + offsets).reshape(-1)


def slots_to_pages(slots: PageIds, page_size: int) -> torch.Tensor:
    """Inverse of ``pages_to_slots``: slots must come as whole pages, each page's slots consecutive and in order.

    SGLang's migration protocol names host KV by token slots (``kv_indices``); this turns them back into pages.
    """
    t = torch.as_tensor(slots if isinstance(slots, torch.Tensor) else list(slots), dtype=torch.int64).cpu()
    if t.dim() != 1 or t.numel() % page_size:
        raise KVCacheError(f"{t.numel()} token slots are not whole pages of {page_size}")
    if t.numel() and int(t.min()) < 0:
        raise KVCacheError("token slots must be non-negative")
    per_page = t.view(-1, page_size)
    pages = per_page[:, 0] // page_size
    if not torch.equal(per_page, pages_to_slots(pages, page_size).view(-1, page_size)):
        raise KVCacheError(f"token slots are not page-aligned runs of {page_size}")
    return pages


class PageAllocator:
    """Free/allocated bookkeeping for page ids ``0 .. num_pages - 1``.

    Contract: ``alloc(n)`` returns the ``n`` lowest free ids (freed ids rejoin in order, so free space that is
    contiguous is handed out as one run: one copy per run for write-back, load-back and transports) and raises
    if ``not can_alloc(n)``; ``free(ids)`` accepts only ids that are allocated now and changes nothing if any is
    not (all or nothing). ``check_integrity()`` holds after every call.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise KVCacheError(f"a pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = torch.arange(num_pages, dtype=torch.int64)
        self._allocated = torch.zeros(num_pages, dtype=torch.bool)

    @property
    def free_pages(self) -> int:
        return self._free.numel()

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._free.numel()

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= self._free.numel()

    def alloc(self, n: int) -> torch.Tensor:
        if not self.can_alloc(n):
            raise KVCacheError(f"cannot allocate {n} pages: {self.free_pages} of {self.num_pages} free")
        ids, self._free = self._free[:n].clone(), self._free[n:]
        self._allocated[ids] = True
        return ids

    def free(self, ids: PageIds) -> None:
        t = as_page_ids(ids, self.num_pages)
        self.check_allocated(t)
        self._allocated[t] = False
        self._free = torch.sort(torch.cat([self._free, t])).values

    def is_allocated(self, ids: PageIds) -> bool:
        t = as_page_ids(ids, self.num_pages)
        return bool(self._allocated[t].all())

    def check_allocated(self, ids: torch.Tensor, what: str = "pages") -> None:
        """Raise KVCacheError if any of ``ids`` (already validated) is free."""
        free = ids[~self._allocated[ids]]
        if free.numel():
            raise KVCacheError(f"{what} not allocated: {free[:8].tolist()}{' ...' if free.numel() > 8 else ''}")

    def check_integrity(self) -> None:
        """free + allocated == total; the free list has no duplicates and no allocated id."""
        n_alloc = int(self._allocated.sum())
        if self._free.numel() + n_alloc != self.num_pages:
            raise KVCacheError(f"allocator: {self._free.numel()} free + {n_alloc} allocated != {self.num_pages}")
        if torch.unique(self._free).numel() != self._free.numel():
            raise KVCacheError("allocator: duplicate ids in the free list")
        if bool(self._allocated[self._free].any()):
            raise KVCacheError("allocator: an id is both free and allocated")


class Paged:
    """What a pool of pages answers through its allocator (``_alloc``), shared by the device and host pools: page
    counts, allocation and freeing, and whether pages are allocated. The pool sets ``_alloc`` and ``page_size``."""

    _alloc: PageAllocator

    @property
    def num_pages(self) -> int:
        return self._alloc.num_pages

    @property
    def free_pages(self) -> int:
        return self._alloc.free_pages

    @property
    def used_pages(self) -> int:
        return self._alloc.used_pages

    def can_alloc(self, n: int) -> bool:
        return self._alloc.can_alloc(n)

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` free page ids (int64, CPU); KVCacheError if ``not can_alloc(n)``."""
        return self._alloc.alloc(n)

    def free(self, pages: PageIds) -> None:
        """Return allocated pages; KVCacheError (nothing freed) on a free, repeated or out-of-range id."""
        self._alloc.free(pages)

    def is_allocated(self, pages: PageIds) -> bool:
        return self._alloc.is_allocated(pages)
