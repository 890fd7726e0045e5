import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmove.errors import KVCacheError
from kvmove.kvcache import PageAllocator, RadixKey, RadixNode, RadixTree

V1, V2 = "v1", "v2"


def key(tokens: list[int], version: str = V1, extra_key: str | None = None) -> RadixKey:
    return RadixKey(tuple(tokens), version, extra_key)


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_match_returns_whole_pages_only(page_size: int) -> None:
    tree = RadixTree(page_size)
    tokens = list(range(3 * page_size))
    tree.insert(key(tokens), pages(7, 8, 9))
    for n in range(len(tokens) + 2):
        m = tree.match_prefix(key([*tokens, 99][:n]))
        assert m.matched_tokens == min(n, len(tokens)) // page_size * page_size
        assert m.pages.tolist() == [7, 8, 9][: m.matched_tokens // page_size]
        tree.check_integrity()
    assert tree.total_pages == 3 and tree.evictable_pages == 3 and tree.protected_pages == 0


def test_diverging_keys_split_at_page_boundaries() -> None:
    tree = RadixTree(2)
    tree.insert(key([1, 2, 3, 4, 5, 6]), pages(0, 1, 2))
    result = tree.insert(key([1, 2, 3, 9, 5, 6]), pages(10, 11, 12))
    assert result.existing_tokens == 2 and result.inserted_tokens == 4
    assert tree.match_prefix(key([1, 2, 3, 9, 5, 6])).pages.tolist() == [0, 11, 12]
    assert tree.match_prefix(key([1, 2, 3, 4, 5, 6])).pages.tolist() == [0, 1, 2]
    assert [len(n.tokens) for n in tree.root.children.values()] == [2], "split after the first page"
    assert tree.total_pages == 5
    tree.check_integrity()


def test_insert_reports_existing_tokens_so_caller_frees_duplicates() -> None:
    tree = RadixTree(2)
    tree.insert(key([1, 2, 3, 4]), pages(0, 1))
    again = tree.insert(key([1, 2, 3, 4, 5, 6]), pages(5, 6, 7))
    assert again.existing_tokens == 4 and again.inserted_tokens == 2
    assert tree.match_prefix(key([1, 2, 3, 4, 5, 6])).pages.tolist() == [0, 1, 7], "tree keeps its own pages"
    full = tree.insert(key([1, 2, 3, 4, 5, 6]), pages(8, 9, 10))
    assert full.existing_tokens == 6 and full.inserted_tokens == 0
    assert tree.total_pages == 3
    tree.check_integrity()


@pytest.mark.parametrize(("tokens", "ids"), [([1, 2, 3], (0, 1)), ([1, 2, 3, 4], (0,)), ([1, 2], (0, 1))])
def test_insert_rejects_partial_pages_or_wrong_page_count(tokens: list[int], ids: tuple[int, ...]) -> None:
    tree = RadixTree(2)
    with pytest.raises(KVCacheError):
        tree.insert(key(tokens), pages(*ids))
    assert tree.total_pages == 0
    tree.check_integrity()


def test_weight_version_is_part_of_the_namespace() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4]
    tree.insert(key(tokens, V1), pages(0, 1))
    assert tree.match_prefix(key(tokens, V2)).matched_tokens == 0, "KV of an old policy version must not match"
    assert tree.collect_pages(key(tokens, V2)).pages.numel() == 0
    assert tree.insert(key(tokens, V2), pages(2, 3)).existing_tokens == 0
    assert tree.match_prefix(key(tokens, V2)).pages.tolist() == [2, 3]
    assert tree.match_prefix(key(tokens, V1)).pages.tolist() == [0, 1]
    tree.check_integrity()


def test_extra_key_is_part_of_the_namespace() -> None:
    tree = RadixTree(1)
    tree.insert(key([1, 2], extra_key="lora-a"), pages(0, 1))
    assert tree.match_prefix(key([1, 2])).matched_tokens == 0
    assert tree.match_prefix(key([1, 2], extra_key="lora-b")).matched_tokens == 0
    assert tree.match_prefix(key([1, 2], extra_key="lora-a")).matched_tokens == 2


def test_evict_stale_drops_old_versions_but_not_locked_ones() -> None:
    tree = RadixTree(1)
    tree.insert(key([1, 2], V1), pages(0, 1))
    tree.insert(key([3, 4], V1), pages(2, 3))
    tree.insert(key([1, 2], V2), pages(4, 5))
    locked = tree.match_prefix(key([3, 4], V1)).last_node
    tree.inc_lock_ref(locked)
    result = tree.evict_stale(V2)
    assert sorted(result.pages.tolist()) == [0, 1]
    assert tree.total_pages == 4 and tree.protected_pages == 2
    tree.check_integrity()
    tree.dec_lock_ref(locked)
    assert sorted(tree.evict_stale(V2).pages.tolist()) == [2, 3]
    assert tree.match_prefix(key([1, 2], V2)).pages.tolist() == [4, 5]
    tree.check_integrity()


def test_locked_path_is_never_evicted() -> None:
    tree = RadixTree(2)
    tree.insert(key([1, 2, 3, 4]), pages(0, 1))
    tree.insert(key([1, 2, 5, 6]), pages(0, 2))
    m = tree.match_prefix(key([1, 2, 3, 4]))
    tree.inc_lock_ref(m.last_node)
    assert tree.protected_pages == 2 and tree.evictable_pages == 1
    assert tree.evict(100).pages.tolist() == [2]
    assert tree.total_pages == 2
    tree.check_integrity()
    tree.dec_lock_ref(m.last_node)
    assert sorted(tree.evict(100).pages.tolist()) == [0, 1]
    assert tree.total_pages == 0
    tree.check_integrity()


def test_lock_survives_a_split_below_it() -> None:
    tree = RadixTree(1)
    tree.insert(key([1, 2, 3, 4]), pages(0, 1, 2, 3))
    node = tree.match_prefix(key([1, 2, 3, 4])).last_node
    tree.inc_lock_ref(node)
    tree.match_prefix(key([1, 2]))  # splits the locked node
    assert tree.protected_pages == 4
    tree.check_integrity()
    tree.dec_lock_ref(node)
    assert tree.protected_pages == 0 and tree.evictable_pages == 4
    tree.check_integrity()


def test_dec_lock_ref_below_zero_raises_and_changes_nothing() -> None:
    tree = RadixTree(1)
    node = tree.insert(key([1, 2]), pages(0, 1)).last_node
    with pytest.raises(KVCacheError, match="unlocked"):
        tree.dec_lock_ref(node)
    assert node.lock_ref == 0
    tree.check_integrity()


def test_evicted_handle_cannot_be_locked() -> None:
    tree = RadixTree(1)
    node = tree.insert(key([1]), pages(0)).last_node
    tree.evict(1)
    with pytest.raises(KVCacheError, match="evicted"):
        tree.inc_lock_ref(node)


def test_eviction_is_least_recently_used_first() -> None:
    tree = RadixTree(1)
    tree.insert(key([1]), pages(0))
    tree.insert(key([2]), pages(1))
    tree.insert(key([3]), pages(2))
    tree.match_prefix(key([1]))
    assert tree.evict(1).pages.tolist() == [1]
    assert tree.evict(1).pages.tolist() == [2]
    assert tree.evict(5).pages.tolist() == [0]
    assert tree.evict(5).num_nodes == 0


def test_evict_takes_whole_leaves_then_their_parents() -> None:
    tree = RadixTree(1)
    tree.insert(key([1, 2, 3]), pages(0, 1, 2))
    tree.insert(key([1, 2, 4, 5]), pages(0, 1, 3, 4))
    result = tree.evict(3)
    assert result.pages.numel() >= 3 and tree.total_pages == 5 - result.pages.numel()
    tree.check_integrity()


def test_collect_pages_walks_the_path_without_changing_the_tree() -> None:
    tree = RadixTree(2)
    tree.insert(key([1, 2, 3, 4, 5, 6]), pages(0, 1, 2))
    tree.insert(key([1, 2, 7, 8]), pages(0, 3))
    before = [(n.id, n.last_access, len(n.tokens)) for n in tree._nodes()]
    path = tree.collect_pages(key([1, 2, 3, 4, 9, 9, 9]))
    assert path.pages.tolist() == [0, 1] and path.matched_tokens == 4
    assert [len(n.tokens) for n in path.nodes] == [2, 4], "the last node is matched in part"
    assert [(n.id, n.last_access, len(n.tokens)) for n in tree._nodes()] == before


def test_check_integrity_detects_corruption() -> None:
    tree = RadixTree(2)
    node = tree.insert(key([1, 2, 3, 4]), pages(0, 1)).last_node
    tree.insert(key([5, 6]), pages(1))  # a caller bug: page 1 cached twice
    with pytest.raises(KVCacheError, match="shares page ids"):
        tree.check_integrity()
    tree = RadixTree(2)
    node = tree.insert(key([1, 2, 3, 4]), pages(0, 1)).last_node
    node.pages = pages(0)
    with pytest.raises(KVCacheError, match="holds 1 pages for 4 tokens"):
        tree.check_integrity()
    node.pages = pages(0, 1)
    node.lock_ref = 1
    with pytest.raises(KVCacheError, match="tracked"):
        tree.check_integrity()


# -- randomized: a model of which page caches which (namespace, prefix) --------------------------------------------

tokens_st = st.lists(st.integers(0, 2), max_size=10)
namespace_st = st.tuples(st.sampled_from([V1, V2]), st.sampled_from([None, "a"]))


class RadixMachine(RuleBasedStateMachine):
    """Engine-like use of a tree over a real allocator, checked against a dict model after every step."""

    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(4, 24))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.tree = RadixTree(page_size)
        self.alloc = PageAllocator(num_pages)
        self.owner: dict[tuple[object, tuple[int, ...]], int] = {}  # (namespace, prefix) -> page caching its last page
        self.held: list[tuple[RadixNode, RadixKey, list[int]]] = []

    def _key(self, tokens: list[int], ns: tuple[str, str | None]) -> RadixKey:
        return RadixKey(tuple(tokens), ns[0], ns[1])

    def _expected(self, k: RadixKey) -> list[int]:
        out = []
        for end in range(self.ps, len(k) + 1, self.ps):
            page = self.owner.get((k.namespace, k.token_ids[:end]))
            if page is None:
                break
            out.append(page)
        return out

    def _alloc_evicting(self, n: int) -> torch.Tensor | None:
        if not self.alloc.can_alloc(n):
            self._evict(n - self.alloc.free_pages)
        return self.alloc.alloc(n) if self.alloc.can_alloc(n) else None

    def _evict(self, n: int) -> None:
        result = self.tree.evict(n)
        freed = set(result.pages.tolist())
        assert result.pages.numel() >= n or self.tree.evictable_pages == 0
        for _, _, held_pages in self.held:
            assert not freed.intersection(held_pages), "a locked page was evicted"
        self.owner = {k: p for k, p in self.owner.items() if p not in freed}
        self.alloc.free(result.pages)

    @rule(tokens=tokens_st, ns=namespace_st)
    def serve_request(self, tokens: list[int], ns: tuple[str, str | None]) -> None:
        """match -> lock -> allocate the tail -> insert -> unlock, like a finished request."""
        k = self._key(tokens, ns).page_aligned(self.ps)
        m = self.tree.match_prefix(k)
        assert m.pages.tolist() == self._expected(k)
        self.tree.inc_lock_ref(m.last_node)
        tail = self._alloc_evicting((len(k) - m.matched_tokens) // self.ps)
        if tail is not None:
            result = self.tree.insert(k, torch.cat([m.pages, tail]))
            assert result.existing_tokens == m.matched_tokens
            for i, page in enumerate(tail.tolist()):
                self.owner[(k.namespace, k.token_ids[: m.matched_tokens + (i + 1) * self.ps])] = page
        self.tree.dec_lock_ref(m.last_node)

    @rule(tokens=tokens_st, ns=namespace_st)
    def insert_recomputed(self, tokens: list[int], ns: tuple[str, str | None]) -> None:
        """A request that computed every page itself: the caller frees the pages the tree already had."""
        k = self._key(tokens, ns).page_aligned(self.ps)
        fresh = self._alloc_evicting(len(k) // self.ps)
        if fresh is None:
            return
        before = self._expected(k)
        result = self.tree.insert(k, fresh)
        assert result.existing_tokens == len(before) * self.ps
        self.alloc.free(fresh[: len(before)])
        for i, page in enumerate(fresh.tolist()[len(before) :], start=len(before)):
            self.owner[(k.namespace, k.token_ids[: (i + 1) * self.ps])] = page

    @rule(tokens=tokens_st, ns=namespace_st)
    def lock(self, tokens: list[int], ns: tuple[str, str | None]) -> None:
        k = self._key(tokens, ns)
        m = self.tree.match_prefix(k)
        self.tree.inc_lock_ref(m.last_node)
        self.held.append((m.last_node, k, m.pages.tolist()))

    @precondition(lambda self: bool(self.held))
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        node, _, _ = self.held.pop(index % len(self.held))
        self.tree.dec_lock_ref(node)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        self._evict(n)

    @rule(version=st.sampled_from([V1, V2]))
    def evict_stale(self, version: str) -> None:
        result = self.tree.evict_stale(version)
        freed = set(result.pages.tolist())
        assert all(p not in freed for k, p in self.owner.items() if k[0][0] == version)  # type: ignore[index]
        self.owner = {k: p for k, p in self.owner.items() if p not in freed}
        self.alloc.free(result.pages)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity()
        self.alloc.check_integrity()
        assert self.alloc.used_pages == self.tree.total_pages == len(self.owner)
        for _, held_key, held_pages in self.held:
            assert self.tree.collect_pages(held_key).pages.tolist()[: len(held_pages)] == held_pages
        locked = {p for node, _, _ in self.held for p in self._path_pages(node)}
        assert len(locked) == self.tree.protected_pages

    def _path_pages(self, node: RadixNode) -> list[int]:
        out: list[int] = []
        while node is not self.tree.root and node.parent is not None:
            out += node.pages.tolist()
            node = node.parent
        return out

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        while self.held:
            self.unlock(0)
        self._evict(self.tree.total_pages)
        assert self.tree.total_pages == 0 and self.alloc.used_pages == 0
        self.tree.check_integrity()


RadixMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
test_radix_random_operations = RadixMachine.TestCase
