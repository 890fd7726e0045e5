"""The rollout worker: continuous batching, priorities under KV pressure, prefix cache, weight versions, migration
hooks (copy K/V to a second worker and resume there) and bad input."""

from __future__ import annotations

import pytest
from engine_helpers import prompt, weights

from kvmove.errors import KVCacheError, KvmoveError
from kvmove.reference import (
    FinishReason,
    Request,
    RequestError,
    RequestState,
    RolloutWorker,
    SamplingParams,
    UnknownRequestError,
)


def _alone(make_worker, req: Request, model: str = "qwen3-tiny") -> list[int]:
    w = make_worker(model)
    w.submit(req.continuation())
    (done,) = w.run_until_idle()
    return done.output_ids


def _step_until(w: RolloutWorker, cond) -> int:
    for n in range(1000):
        if cond():
            return n
        w.step()
        w.check_integrity()
    raise AssertionError("condition never held")


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_continuous_batching_gives_each_request_its_solo_output(model: str, make_worker) -> None:
    reqs = [Request(f"r{i}", prompt(5 + 3 * i, seed=i), SamplingParams(max_new_tokens=4 + 2 * i)) for i in range(4)]
    w = make_worker(model)
    w.submit(reqs[0])
    w.submit(reqs[1])
    outs = [w.step(), w.step()]
    w.submit(reqs[2])
    w.submit(reqs[3])
    outs += [w.step() for _ in range(3)]
    assert any(o.prefill_tokens and o.decode_tokens for o in outs), "a step prefilled while others decoded"
    w.run_until_idle()
    for r in reqs:
        assert r.state is RequestState.FINISHED and r.finish_reason is FinishReason.LENGTH
        assert r.output_ids == _alone(make_worker, Request(r.rid, r.prompt_ids, r.sampling), model)


def test_high_priority_queues_behind_kv_pressure_then_runs_first(make_worker) -> None:
    w = make_worker(num_pages=10, page_size=4)  # 40 token slots
    low1 = Request("low1", prompt(6, 1), SamplingParams(max_new_tokens=8))  # 13 KV tokens: 4 pages
    low2 = Request("low2", prompt(6, 2), SamplingParams(max_new_tokens=19))  # 24 KV tokens: 6 pages
    w.submit(low1)
    w.submit(low2)
    w.step()
    assert w.stats().free_pages == 0
    low3 = Request("low3", prompt(4, 3), SamplingParams(max_new_tokens=10))  # 4 pages
    high = Request("high", prompt(12, 4), SamplingParams(max_new_tokens=17), priority=5)  # 7 pages
    w.submit(low3)
    w.submit(high)
    w.step()
    assert w.stats().waiting_per_priority == {5: 1, 0: 1}
    _step_until(w, lambda: low1.finished)
    # 4 pages came back: low3 would fit, the high-priority head does not, and nothing overtakes it
    w.step()
    assert high.state is RequestState.WAITING and low3.state is RequestState.WAITING
    assert w.stats().running == 1
    _step_until(w, lambda: high.state is RequestState.RUNNING)
    assert low2.finished, "high was admitted only once low2's pages were free"
    assert low3.state is RequestState.WAITING, "high runs first; low3 waits for its pages"
    _step_until(w, lambda: low3.state is RequestState.RUNNING)
    assert high.finished
    w.run_until_idle()
    for r in (high, low3):
        assert r.output_ids == _alone(make_worker, Request(r.rid, r.prompt_ids, r.sampling))


def test_prefix_cache_hit_skips_recomputation(make_worker) -> None:
    w = make_worker()
    base = prompt(18, seed=7)
    a = Request("a", base, SamplingParams(max_new_tokens=3))
    w.submit(a)
    w.run_until_idle()
    before = w.stats()
    b = Request("b", [*a.all_ids[:20], 1, 2, 3], SamplingParams(max_new_tokens=6))
    w.submit(b)
    w.step()
    assert b.cached_tokens == 20  # 18 prompt + 2 decoded tokens with K/V = 20 = 5 whole pages
    assert w.stats().prefill_tokens - before.prefill_tokens == b.num_tokens - 1 - 20
    other_ns = Request("c", b.prompt_ids, SamplingParams(max_new_tokens=6), extra_key="other")
    w.submit(other_ns)
    w.run_until_idle()
    assert other_ns.cached_tokens == 0, "extra_key namespaces the cache"
    assert b.output_ids == other_ns.output_ids == _alone(make_worker, Request("b", b.prompt_ids, b.sampling))


def test_full_prompt_hit_still_computes_the_last_token(make_worker) -> None:
    w = make_worker()
    ids = prompt(16, seed=2)
    for rid in ("x", "y"):
        w.submit(Request(rid, ids, SamplingParams(max_new_tokens=5)))
        w.run_until_idle()
    x = w.stats()
    assert x.cached_tokens == 12 and x.prefill_tokens == 16 + 4


def test_weight_version_change_never_reuses_old_kv(make_worker) -> None:
    w = make_worker()
    ids = prompt(17, seed=11)
    w.submit(Request("a", ids, SamplingParams(max_new_tokens=6)))
    old = w.run_until_idle()[0].output_ids
    assert w.stats().cached_pages > 0
    w.update_weights(weights("qwen3-tiny", seed=2).items(), version="1")
    assert w.stats().cached_pages == 0, "stale K/V evicted"
    again = Request("b", ids, SamplingParams(max_new_tokens=6))
    w.submit(again)
    w.run_until_idle()
    assert again.cached_tokens == 0
    fresh = make_worker(seed=2)
    fresh.submit(Request("b", ids, SamplingParams(max_new_tokens=6)))
    assert again.output_ids == fresh.run_until_idle()[0].output_ids != old


def test_locked_old_version_kv_is_not_matched(make_worker) -> None:
    w = make_worker()
    ids = prompt(12, seed=4)
    w.submit(Request("a", ids, SamplingParams(max_new_tokens=2)))
    w.run_until_idle()
    exported = w.export_request_kv(tokens=ids, lock=True)  # pins version-0 K/V
    w.set_weight_version("1")
    assert w.stats().cached_pages == exported.pages.numel()
    b = Request("b", ids, SamplingParams(max_new_tokens=2))
    w.submit(b)
    w.run_until_idle()
    assert b.cached_tokens == 0
    w.unlock_export(exported)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("dedup", [False, True])
def test_copy_kv_to_second_worker_and_resume_equals_uninterrupted(make_worker, temperature: float, dedup: bool) -> None:
    ids = prompt(10, seed=21)
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=5)
    whole = _alone(make_worker, Request("r", ids, params))

    src, dst = make_worker(num_pages=16), make_worker(num_pages=24)
    dst.submit(Request("filler", prompt(9, seed=99), SamplingParams(max_new_tokens=3)))  # other cache: ids differ
    if dedup:  # the target already caches the first two pages of the prompt
        dst.submit(Request("warm", ids[:9], SamplingParams(max_new_tokens=1)))
    dst.run_until_idle()
    req = Request("r", ids, params)
    src.submit(req)
    src.submit(Request("bystander", prompt(7, seed=3), SamplingParams(max_new_tokens=12)))
    for _ in range(1 + 7):  # prefill, then 7 decode steps
        src.step()
    assert len(req.output_ids) == 8 and req.kv_len == 17

    exported = src.export_request_kv(rid="r")
    assert exported.num_tokens == 16 and list(exported.token_ids) == req.all_ids[:16]
    have = dst.export_request_kv(tokens=list(exported.token_ids), lock=True)
    assert have.num_tokens == (8 if dedup else 0)
    tail = exported.pages[have.pages.numel() :]
    pages = dst.alloc_import_pages(tail.numel())
    for s, d in zip(src.pool.page_views(), dst.pool.page_views(), strict=True):
        d[pages] = s[tail]
    imported = dst.import_kv(list(exported.token_ids), None, pages)
    assert (imported.existing_tokens, imported.inserted_tokens) == (have.num_tokens, 16 - have.num_tokens)
    if have.node is not None:
        dst.unlock_export(have)
    handed = src.abort("r").continuation()  # the source lets go only after the target holds the K/V
    before = dst.stats()
    dst.submit(handed)
    dst.run_until_idle()
    after = dst.stats()
    assert handed.output_ids == whole
    assert handed.cached_tokens == 16
    assert after.prefill_tokens - before.prefill_tokens == 18 - 16, "only the partial last page is recomputed"
    assert handed.computed_tokens == 2 + (16 - 8 - 1)
    src.run_until_idle()


def test_abort_waiting_and_running(make_worker) -> None:
    w = make_worker(num_pages=6)
    a = Request("a", prompt(8, 1), SamplingParams(max_new_tokens=10))
    b = Request("b", prompt(8, 2), SamplingParams(max_new_tokens=10))
    w.submit(a)
    w.submit(b)
    w.step()
    assert a.state is RequestState.RUNNING and b.state is RequestState.WAITING
    assert w.abort("b") is b and b.state is RequestState.ABORTED
    w.step()
    w.abort("a")
    assert a.finish_reason is FinishReason.ABORT and w.is_idle
    assert w.stats().cached_pages == a.kv_len // 4, "the computed whole pages stay cached"
    w.check_integrity()


def test_stop_token_finishes_early(make_worker) -> None:
    ids = prompt(9, seed=8)
    full = _alone(make_worker, Request("r", ids, SamplingParams(max_new_tokens=8)))
    w = make_worker()
    r = Request("r", ids, SamplingParams(max_new_tokens=8, stop_token_ids=(full[2],)))
    w.submit(r)
    w.run_until_idle()
    assert r.finish_reason is FinishReason.STOP
    assert r.output_ids == full[: full.index(full[2]) + 1]


def test_bad_input_raises_clear_errors(make_worker) -> None:
    w = make_worker(num_pages=4)
    with pytest.raises(RequestError, match="empty prompt"):
        w.submit(Request("e", []))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        w.submit(Request("v", [1, 256]))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        w.submit(Request("n", [-1]))
    with pytest.raises(RequestError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(RequestError, match="KV pages"):
        w.submit(Request("big", [1] * 16, SamplingParams(max_new_tokens=8)))
    with pytest.raises(UnknownRequestError, match="nope"):
        w.abort("nope")
    w.submit(Request("d", [1, 2], SamplingParams(max_new_tokens=2)))
    with pytest.raises(RequestError, match="already"):
        w.submit(Request("d", [3]))
    with pytest.raises(UnknownRequestError, match="not running"):
        w.export_request_kv(rid="d")
    with pytest.raises(KvmoveError, match="exactly one"):
        w.export_request_kv()
    with pytest.raises(KVCacheError, match="alloc_import"):
        w.import_kv([1, 2, 3, 4], None, [0])
    pages = w.alloc_import_pages(1)
    with pytest.raises(KVCacheError, match="must be cached"):
        w.import_kv(list(range(8)), None, pages)
    w.free_import_pages(pages)
    w.abort("d")
    assert w.is_idle
