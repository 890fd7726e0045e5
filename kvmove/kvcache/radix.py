"""Radix tree of cached KV pages, keyed by (weight version, extra_key, page-aligned token ids).

Every edge holds whole pages: a node's ``tokens`` has a multiple of ``page_size`` tokens and its ``pages`` one page
id per ``page_size`` tokens. The page ids are opaque (device or host pool pages); the tree never frees them itself,
it hands evicted ids back to the caller, which owns the pool.

Namespaces: a key's ``weight_version`` and ``extra_key`` form its namespace. Children are keyed by
``(namespace, first page of tokens)``, so two keys in different namespaces never share a node: KV computed under
an old policy version cannot match a key of the new version, however equal the tokens. Stale namespaces age out by
LRU or all at once with ``evict_stale``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvmove.errors import KVCacheError


class Namespace(NamedTuple):
    weight_version: str
    extra_key: str | None


@dataclass(frozen=True)
class RadixKey:
    """Token ids in one namespace. ``weight_version`` is required so that no caller forgets it."""

    token_ids: tuple[int, ...]
    weight_version: str
    extra_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.weight_version, self.extra_key)

    def __len__(self) -> int:
        return len(self.token_ids)

    def page_aligned(self, page_size: int) -> RadixKey:
        """The longest prefix made of whole pages."""
        n = len(self.token_ids) // page_size * page_size
        return self if n == len(self.token_ids) else RadixKey(self.token_ids[:n], self.weight_version, self.extra_key)


_ChildKey = tuple[Namespace, tuple[int, ...]]
_ids = itertools.count()


class RadixNode:
    """One edge of the tree: ``tokens`` (whole pages) and their ``pages``. Handles stay valid while locked."""

    __slots__ = ("children", "id", "last_access", "lock_ref", "namespace", "pages", "parent", "tokens")

    def __init__(
        self, namespace: Namespace | None, tokens: tuple[int, ...], pages: torch.Tensor, parent: RadixNode | None
    ) -> None:
        self.id = next(_ids)
        self.namespace = namespace
        self.tokens = tokens
        self.pages = pages
        self.parent = parent
        self.children: dict[_ChildKey, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    @property
    def num_pages(self) -> int:
        return self.pages.numel()

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, tokens={len(self.tokens)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """``pages`` of the first ``matched_tokens`` tokens; ``last_node`` ends exactly there (root if nothing)."""

    pages: torch.Tensor
    last_node: RadixNode
    matched_tokens: int


class InsertResult(NamedTuple):
    """``existing_tokens`` of the key were cached before: the tree kept its own pages for them, so the caller
    frees those of its ``pages[: existing_tokens // page_size]`` that the tree does not own."""

    existing_tokens: int
    inserted_tokens: int
    last_node: RadixNode


class PathPages(NamedTuple):
    """Pages cached along a key's path, and the nodes they came from (the last one may be matched in part)."""

    pages: torch.Tensor
    nodes: tuple[RadixNode, ...]
    matched_tokens: int


class EvictResult(NamedTuple):
    """Page ids removed from the tree; the caller frees them in its pool."""

    pages: torch.Tensor
    num_nodes: int


_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixTree:
    """Prefix cache of KV pages with lock refs and LRU eviction.

    Contract:
    - ``match_prefix`` and ``insert`` work on whole pages only: ``match_prefix`` ignores a key's partial last page,
      ``insert`` rejects one. Both may split a node at a page boundary; splitting never changes what is cached.
    - ``inc_lock_ref(node)`` pins ``node`` and all its ancestors; pinned pages are never evicted. Lock the
      ``last_node`` of a match before using its pages; every ``inc_lock_ref`` needs one ``dec_lock_ref`` on the same
      handle.
    - ``evict`` removes whole unlocked leaves, least recently used first, and returns their page ids.
    - ``check_integrity()`` holds after every public call.
    """

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise KVCacheError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = RadixNode(None, (), _EMPTY, None)
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    @property
    def total_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def evictable_pages(self) -> int:
        """Pages of unlocked nodes (evictable once their descendants are gone)."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Pages of locked nodes."""
        return self._protected

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached whole-page prefix of ``key``; marks the path as recently used."""
        key = key.page_aligned(self.page_size)
        now = self._tick()
        node, matched, pages = self.root, 0, []
        for child, common in self._walk(key):
            child.last_access = now
            if common < len(child.tokens):
                child = self._split(child, common)
            node, matched = child, matched + common
            pages.append(child.pages)
        return MatchResult(torch.cat(pages) if pages else _EMPTY, node, matched)

    def insert(self, key: RadixKey, pages: torch.Tensor | Sequence[int]) -> InsertResult:
        """Cache ``pages`` (one id per page of ``key``) for ``key``, keeping the tree's pages where it has some."""
        n = len(key)
        if n % self.page_size:
            raise KVCacheError(f"insert: {n} tokens are not whole pages of {self.page_size}")
        page_ids = torch.as_tensor(pages if isinstance(pages, torch.Tensor) else list(pages), dtype=torch.int64)
        if page_ids.dim() != 1 or page_ids.numel() != n // self.page_size:
            raise KVCacheError(f"insert: {n} tokens need {n // self.page_size} pages, got {tuple(page_ids.shape)}")
        now = self._tick()
        node, matched = self.root, 0
        for child, common in self._walk(key):
            child.last_access = now
            if common < len(child.tokens):
                child = self._split(child, common)
            node, matched = child, matched + common
        if matched < n:
            new = RadixNode(key.namespace, key.token_ids[matched:], page_ids[matched // self.page_size :].cpu(), node)
            new.last_access = now
            node.children[self._child_key(key.namespace, new.tokens)] = new
            self._evictable += new.num_pages
            node = new
        return InsertResult(matched, n - matched, node)

    def collect_pages(self, key: RadixKey) -> PathPages:
        """Pages along ``key``'s whole-page path and the nodes holding them; changes nothing (no split, no LRU)."""
        key = key.page_aligned(self.page_size)
        pages, nodes, matched = [], [], 0
        for child, common in self._walk(key):
            pages.append(child.pages[: common // self.page_size])
            nodes.append(child)
            matched += common
        return PathPages(torch.cat(pages) if pages else _EMPTY, tuple(nodes), matched)

    def inc_lock_ref(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction."""
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                self._evictable -= n.num_pages
                self._protected += n.num_pages
            n.lock_ref += 1

    def dec_lock_ref(self, node: RadixNode) -> None:
        """Undo one ``inc_lock_ref(node)``; KVCacheError (nothing changed) if the path is not locked."""
        path = self._path_to_root(node)
        if any(n.lock_ref <= 0 for n in path):
            raise KVCacheError(f"dec_lock_ref on an unlocked path ending at {node!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= n.num_pages
                self._evictable += n.num_pages

    def evict(self, num_pages: int) -> EvictResult:
        """Evict least recently used unlocked leaves until at least ``num_pages`` pages are freed or none is left."""
        return self._evict(num_pages, lambda n: True)

    def evict_stale(self, weight_version: str) -> EvictResult:
        """Evict every unlocked node cached under a weight version other than ``weight_version``."""
        return self._evict(
            self.total_pages, lambda n: n.namespace is not None and n.namespace.weight_version != weight_version
        )

    def check_integrity(self) -> None:
        """Raise KVCacheError unless every structural invariant and page count holds."""
        root = self.root
        if root.tokens or root.num_pages or root.lock_ref or root.parent is not None:
            raise KVCacheError("radix: root must hold nothing and stay unlocked")
        seen: set[int] = set()
        evictable = protected = 0
        for node in self._nodes():
            self._check_node(node, seen)
            if node.lock_ref > 0:
                protected += node.num_pages
            else:
                evictable += node.num_pages
        if (evictable, protected) != (self._evictable, self._protected):
            raise KVCacheError(
                f"radix: counted {evictable} evictable + {protected} protected pages, "
                f"tracked {self._evictable} + {self._protected}"
            )

    def _check_node(self, node: RadixNode, seen: set[int]) -> None:
        ps = self.page_size
        parent = node.parent
        if parent is None or node.namespace is None:
            raise KVCacheError(f"radix: {node!r} is detached or has no namespace")
        if parent.children.get(self._child_key(node.namespace, node.tokens)) is not node:
            raise KVCacheError(f"radix: {node!r} is not under its own child key")
        if parent is not self.root and parent.namespace != node.namespace:
            raise KVCacheError(f"radix: {node!r} is in another namespace than its parent")
        if not node.tokens or len(node.tokens) % ps or node.pages.dim() != 1:
            raise KVCacheError(f"radix: {node!r} does not hold whole pages")
        if node.num_pages != len(node.tokens) // ps or node.pages.dtype != torch.int64:
            raise KVCacheError(f"radix: {node!r} holds {node.num_pages} pages for {len(node.tokens)} tokens")
        if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
            raise KVCacheError(f"radix: {node!r} has fewer locks than its children together")
        ids = node.pages.tolist()
        if seen.intersection(ids) or len(set(ids)) != len(ids):
            raise KVCacheError(f"radix: {node!r} shares page ids with another node")
        seen.update(ids)

    def _child_key(self, namespace: Namespace, tokens: tuple[int, ...]) -> _ChildKey:
        return namespace, tokens[: self.page_size]

    def _walk(self, key: RadixKey) -> Iterator[tuple[RadixNode, int]]:
        """Yield (node, tokens of it matched) along ``key``'s path; the last node may be matched in part."""
        ps, tokens, node, i = self.page_size, key.token_ids, self.root, 0
        while i < len(tokens):
            child = node.children.get(self._child_key(key.namespace, tokens[i : i + ps]))
            if child is None:
                return
            common = ps  # NOTE: the child key already equals the first page
            limit = min(len(child.tokens), len(tokens) - i)
            while common + ps <= limit and child.tokens[common : common + ps] == tokens[i + common : i + common + ps]:
                common += ps
            partial = common < len(child.tokens)  # NOTE: before yielding: the caller may split ``child``
            yield child, common
            if partial:
                return
            node, i = child, i + common

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after ``at`` tokens (whole pages); returns the new upper part, which inherits the locks."""
        parent, cut = node.parent, at // self.page_size
        assert parent is not None and node.namespace is not None
        upper = RadixNode(node.namespace, node.tokens[:at], node.pages[:cut].clone(), parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        parent.children[self._child_key(node.namespace, node.tokens)] = upper
        node.tokens, node.pages, node.parent = node.tokens[at:], node.pages[cut:].clone(), upper
        upper.children[self._child_key(node.namespace, node.tokens)] = node
        return upper

    def _path_to_root(self, node: RadixNode) -> list[RadixNode]:
        path = []
        n: RadixNode | None = node
        while n is not self.root:
            if n is None:
                raise KVCacheError(f"{node!r} is no longer in the tree (evicted)")
            path.append(n)
            n = n.parent
        return path

    def _evict(self, num_pages: int, wanted: Callable[[RadixNode], bool]) -> EvictResult:
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and not n.lock_ref and wanted(n)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while heap and count < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and leaf.namespace is not None
            del parent.children[self._child_key(leaf.namespace, leaf.tokens)]
            leaf.parent = None
            self._evictable -= leaf.num_pages
            freed.append(leaf.pages)
            count += leaf.num_pages
            if parent is not self.root and not parent.children and not parent.lock_ref and wanted(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return EvictResult(torch.cat(freed) if freed else _EMPTY, len(freed))

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
