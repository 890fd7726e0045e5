"""Scheduler and KV manager without a model: admission order, budgets, page ownership and its invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmove.kvcache import KVGeometry, KVPool
from kvmove.reference import Request, SamplingParams
from kvmove.reference.kv_manager import KVManager
from kvmove.reference.scheduler import Scheduler

PAGE = 4


def _kv(num_pages: int) -> KVManager:
    return KVManager(KVPool(KVGeometry(1, 1, 2, PAGE, torch.float32), num_pages), "0")


def _req(rid: str, n: int, new: int = 1, priority: int = 0, first: int = 0) -> Request:
    return Request(rid, [first + i for i in range(n)], SamplingParams(max_new_tokens=new), priority=priority)


def _fake_run(s: Scheduler, batch) -> list[Request]:
    """What the runner does to the bookkeeping: every scheduled token gets K/V, one token is sampled."""
    for r in batch.requests:
        r.kv_len = r.num_tokens
    return s.postprocess(batch, {r.rid: 7 for r in batch.requests})


@pytest.mark.parametrize(
    ("priorities", "order"),
    [([0, 1, 2], ["r2", "r1", "r0"]), ([1, 1, 0], ["r0", "r1", "r2"]), ([0, 5, 0], ["r1", "r0", "r2"])],
)
def test_admission_follows_priority_then_arrival(priorities: list[int], order: list[str]) -> None:
    s = Scheduler(_kv(64), max_running=1)
    for i, p in enumerate(priorities):
        s.add(_req(f"r{i}", 4, priority=p, first=10 * i))
    admitted = []
    while s.num_waiting or s.running:
        batch = s.schedule()
        admitted += [r.rid for r in batch.prefill]
        _fake_run(s, batch)
        s.kv.check_integrity()
    assert admitted == order


def test_head_that_does_not_fit_blocks_lower_priorities() -> None:
    s = Scheduler(_kv(4))
    s.add(_req("hog", 8, new=5))  # 12 KV tokens: 3 pages
    s.schedule()
    s.add(_req("small", 2, first=50))  # 1 page: would fit
    s.add(_req("high", 6, new=3, priority=1, first=90))  # 2 pages: does not
    assert s.schedule().prefill == ()
    assert s.queue_lengths() == {1: 1, 0: 1}


def test_prefill_token_budget_and_running_cap() -> None:
    s = Scheduler(_kv(64), max_running=3, max_prefill_tokens=10)
    for i in range(5):
        s.add(_req(f"r{i}", 6, first=10 * i))
    assert [r.rid for r in s.schedule().prefill] == ["r0"]  # 6 + 6 > 10
    batch = s.schedule()
    assert [r.rid for r in batch.prefill] == ["r1"] and [r.rid for r in batch.decode] == ["r0"]
    s.schedule()
    assert len(s.running) == 3 and s.schedule().prefill == ()


def test_an_oversized_first_prompt_is_still_admitted_alone() -> None:
    s = Scheduler(_kv(64), max_prefill_tokens=4)
    s.add(_req("long", 20))
    assert [r.rid for r in s.schedule().prefill] == ["long"]


def test_concurrent_identical_prompts_cache_once() -> None:
    kv = _kv(16)
    s = Scheduler(kv)
    s.add(_req("a", 9, new=2))
    s.add(_req("b", 9, new=2))
    while s.running or s.num_waiting:
        _fake_run(s, s.schedule())
    kv.check_integrity()
    assert kv.tree.total_pages == 2 and kv.pool.used_pages == 2, "b's duplicate pages were freed"


def test_admission_evicts_lru_cache_but_not_the_matched_prefix() -> None:
    kv = _kv(4)
    s = Scheduler(kv)
    s.add(_req("a", 8, new=1))  # caches 2 pages
    _fake_run(s, s.schedule())
    s.add(_req("b", 9, new=8))  # 16 KV tokens: reuses a's 2 pages, needs 2 more: fits
    batch = s.schedule()
    assert [r.cached_tokens for r in batch.prefill] == [8]
    kv.check_integrity()
    s.add(_req("c", 4, new=1, first=100))  # 1 page: nothing is evictable (a's pages are locked by b)
    assert s.schedule().prefill == ()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["submit", "step", "abort", "version", "import"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=14),
            st.integers(1, 6),
        ),
        max_size=30,
    )
)
def test_page_ownership_invariants_under_random_operations(ops) -> None:
    kv = _kv(12)
    s = Scheduler(kv, max_running=3)
    version = 0
    for n, (op, tokens, k) in enumerate(ops):
        if op == "submit":
            r = Request(f"r{n}", tokens, SamplingParams(max_new_tokens=k), priority=k % 2)
            if kv.pages_for(r.max_kv_tokens) <= 12:
                s.add(r)
        elif op == "step":
            _fake_run(s, s.schedule())
        elif op == "abort" and (s.running or s.num_waiting):
            rids = sorted([*s.running, *(r.rid for q in s.waiting.values() for r in q)])
            s.abort(rids[k % len(rids)])
        elif op == "version":
            version += 1
            kv.set_weight_version(str(version))
        elif op == "import" and PAGE <= len(tokens) <= (kv.pool.free_pages + kv.tree.evictable_pages) * PAGE:
            pages = kv.alloc_import(len(tokens) // PAGE)
            kv.import_kv(tokens[: pages.numel() * PAGE], None, pages) if k % 2 else kv.free_import(pages)
        kv.check_integrity()
    while s.running or s.num_waiting:
        _fake_run(s, s.schedule())
    kv.check_integrity()
    assert kv.tree.protected_pages == 0
