"""Who owns each page of a worker's KV pool: the radix tree, a running request, or a pending import.

Every allocated page has exactly one owner:
- the tree (cached prefixes; evictable unless locked),
- a running request (its ``KVAllocation.own_pages``: reserved at admission for all the KV it can ever need),
- an import in progress (``alloc_import`` until ``import_kv`` or ``free_import``).
A request's page table is the tree pages of its matched prefix (locked while it runs) followed by its own pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache import KVPool, RadixKey, RadixNode, RadixTree
from kvmove.kvcache.allocator import PageIds, as_page_ids


class PrefixMatch(NamedTuple):
    """What admitting a request takes: ``pages`` cached for its first ``cached_tokens`` tokens, plus
    ``need_pages`` fresh pages."""

    pages: torch.Tensor
    node: RadixNode
    cached_tokens: int
    need_pages: int


@dataclass
class KVAllocation:
    """A running request's page table; ``node`` (the end of its cached prefix) stays locked until release."""

    node: RadixNode
    prefix_pages: torch.Tensor
    own_pages: torch.Tensor
    weight_version: str

    @property
    def pages(self) -> torch.Tensor:
        return torch.cat([self.prefix_pages, self.own_pages])


class ExportedKV(NamedTuple):
    """Pages holding the K/V of ``token_ids`` (whole pages), in order. ``node`` is locked if the export was."""

    token_ids: tuple[int, ...]
    pages: torch.Tensor
    weight_version: str
    extra_key: str | None
    node: RadixNode | None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ImportResult(NamedTuple):
    """``existing_tokens`` were cached already (their imported pages were freed); ``inserted_tokens`` are new."""

    existing_tokens: int
    inserted_tokens: int


class KVManager:
    def __init__(self, pool: KVPool, weight_version: str) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.tree = RadixTree(pool.page_size)
        self.weight_version = weight_version
        self._allocs: dict[int, KVAllocation] = {}
        self._imports: set[int] = set()
        self._export_locks = 0

    def key(self, token_ids: list[int] | tuple[int, ...], extra_key: str | None) -> RadixKey:
        return RadixKey(tuple(token_ids), self.weight_version, extra_key)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- admission and release of requests ------------------------------------------------------------------------

    def match(self, token_ids: list[int], extra_key: str | None, max_kv_tokens: int) -> PrefixMatch:
        """The cached prefix of ``token_ids`` (leaving at least the last token to compute) and the pages to add."""
        usable = (len(token_ids) - 1) // self.page_size * self.page_size
        m = self.tree.match_prefix(self.key(token_ids[:usable], extra_key))
        return PrefixMatch(m.pages, m.last_node, m.matched_tokens, self.pages_for(max_kv_tokens) - m.pages.numel())

    def can_admit(self, m: PrefixMatch) -> bool:
        """Whether ``need_pages`` fit in free pages plus what eviction can free without touching ``m``'s path."""
        on_path = 0
        node: RadixNode | None = m.node
        while node is not None and node is not self.tree.root:
            on_path += node.num_pages if node.lock_ref == 0 else 0
            node = node.parent
        return m.need_pages <= self.pool.free_pages + self.tree.evictable_pages - on_path

    def admit(self, m: PrefixMatch) -> KVAllocation:
        """Lock ``m``'s prefix and reserve its fresh pages (evicting LRU cache as needed); needs ``can_admit(m)``."""
        self.tree.inc_lock_ref(m.node)
        try:
            own = self._alloc(m.need_pages)
        except KVCacheError:
            self.tree.dec_lock_ref(m.node)
            raise
        alloc = KVAllocation(m.node, m.pages, own, self.weight_version)
        self._allocs[id(alloc)] = alloc
        return alloc

    def release(self, alloc: KVAllocation, token_ids: list[int], extra_key: str | None) -> None:
        """Cache the whole pages of ``token_ids`` (whose K/V the allocation holds), free the rest, unlock."""
        del self._allocs[id(alloc)]
        full = len(token_ids) // self.page_size
        pages = alloc.pages
        key = RadixKey(tuple(token_ids[: full * self.page_size]), alloc.weight_version, extra_key)
        existing = self.tree.insert(key, pages[:full]).existing_tokens // self.page_size
        n_prefix = alloc.prefix_pages.numel()
        # NOTE: pages [n_prefix, existing) duplicate what another request cached meanwhile: the tree kept its own.
        dup = pages[n_prefix:existing] if existing > n_prefix else pages[:0]
        self.pool.free(torch.cat([dup, pages[max(full, n_prefix) :]]))
        self.tree.dec_lock_ref(alloc.node)

    # -- migration: export, import ---------------------------------------------------------------------------------

    def export_alloc(self, alloc: KVAllocation, token_ids: list[int], extra_key: str | None) -> ExportedKV:
        """The whole pages of a running request's computed K/V (``token_ids`` are those tokens)."""
        full = len(token_ids) // self.page_size
        tokens = tuple(token_ids[: full * self.page_size])
        return ExportedKV(tokens, alloc.pages[:full], alloc.weight_version, extra_key, None)

    def export_cached(self, token_ids: list[int], extra_key: str | None, lock: bool) -> ExportedKV:
        """The cached whole-page prefix of ``token_ids``; ``lock`` pins it until ``unlock_export``."""
        m = self.tree.match_prefix(self.key(token_ids, extra_key))
        node = None
        if lock and m.matched_tokens:
            node = m.last_node
            self.tree.inc_lock_ref(node)
            self._export_locks += 1
        return ExportedKV(tuple(token_ids[: m.matched_tokens]), m.pages, self.weight_version, extra_key, node)

    def unlock_export(self, exported: ExportedKV) -> None:
        if exported.node is None:
            raise KVCacheError("unlock_export: this export holds no lock")
        self.tree.dec_lock_ref(exported.node)
        self._export_locks -= 1

    def alloc_import(self, num_pages: int) -> torch.Tensor:
        """Reserve pages to receive imported K/V (evicting LRU cache as needed)."""
        pages = self._alloc(num_pages)
        self._imports.update(pages.tolist())
        return pages

    def free_import(self, pages: PageIds) -> None:
        ids = self._import_ids(pages)
        self._imports.difference_update(ids.tolist())
        self.pool.free(ids)

    def import_kv(self, token_ids: list[int], extra_key: str | None, pages: PageIds) -> ImportResult:
        """Cache ``pages`` (from ``alloc_import``, K/V already written) as the K/V of the tail of ``token_ids``.

        ``pages`` hold the last ``len(pages)`` whole pages of ``token_ids``; the pages before them (the prefix the
        target had already, which the caller keeps locked) must be cached now, else KVCacheError and nothing changes.
        """
        ids = self._import_ids(pages)
        if len(token_ids) % self.page_size:
            raise KVCacheError(f"import: {len(token_ids)} tokens are not whole pages of {self.page_size}")
        head = len(token_ids) // self.page_size - ids.numel()
        if head < 0:
            raise KVCacheError(f"import: {ids.numel()} pages for {len(token_ids)} tokens of pages of {self.page_size}")
        m = self.tree.match_prefix(self.key(token_ids[: head * self.page_size], extra_key))
        if m.pages.numel() != head:
            raise KVCacheError(f"import: the first {head} pages must be cached, only {m.pages.numel()} are")
        res = self.tree.insert(self.key(token_ids, extra_key), torch.cat([m.pages, ids]))
        dup = max(0, res.existing_tokens // self.page_size - head)
        self._imports.difference_update(ids.tolist())
        if dup:
            self.pool.free(ids[:dup])
        return ImportResult(res.existing_tokens, res.inserted_tokens)

    # -- weight versions, accounting -------------------------------------------------------------------------------

    def set_weight_version(self, version: str) -> int:
        """Switch the namespace new K/V is cached under; evicts unlocked K/V of other versions (pages freed)."""
        self.weight_version = version
        evicted = self.tree.evict_stale(version).pages
        self.pool.free(evicted)
        return evicted.numel()

    @property
    def request_pages(self) -> int:
        return sum(a.own_pages.numel() for a in self._allocs.values())

    @property
    def import_pages(self) -> int:
        return len(self._imports)

    @property
    def export_locks(self) -> int:
        """Locks taken by ``export_cached(lock=True)`` and not yet released."""
        return self._export_locks

    def check_integrity(self) -> None:
        """Pool and tree invariants; used == cached + requests' + imports'; no lock left when nothing holds one."""
        self.pool.check_integrity()
        self.tree.check_integrity()
        owned = self.tree.total_pages + self.request_pages + self.import_pages
        if self.pool.used_pages != owned:
            raise KVCacheError(
                f"KV pages: {self.pool.used_pages} used != {self.tree.total_pages} cached + "
                f"{self.request_pages} in requests + {self.import_pages} importing"
            )
        if not self._allocs and not self._export_locks and self.tree.protected_pages:
            raise KVCacheError(f"KV pages: {self.tree.protected_pages} cached pages locked with no holder")

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.pool.free_pages
        if short > 0:
            self.pool.free(self.tree.evict(short).pages)
        return self.pool.alloc(n)

    def _import_ids(self, pages: PageIds) -> torch.Tensor:
        ids = as_page_ids(pages, self.pool.num_pages, "import pages")
        foreign = set(ids.tolist()) - self._imports
        if foreign:
            raise KVCacheError(f"pages {sorted(foreign)[:8]} were not reserved by alloc_import")
        return ids
