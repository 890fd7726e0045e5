"""A worker of several tensor-parallel ranks in one process: each rank its heads, its MLP slice and its own KV pool
(one page table); it generates what the tp=1 worker and the dense reference generate."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import dense_greedy, prompt, weights

from kvmove.errors import KvmoveError, ModelError
from kvmove.models import resolve_model
from kvmove.reference import Request, SamplingParams


@pytest.mark.parametrize(
    ("model", "tp"), [("qwen3-tiny", 2), ("qwen3-moe-tiny", 2), ("qwen2-tiny", 2), ("qwen3-tiny", 4)]
)
def test_tp_worker_generates_the_dense_greedy_tokens(make_worker, model: str, tp: int) -> None:
    w = make_worker(model, tp_size=tp)
    ids = prompt(13, seed=4)
    w.submit(Request("a", ids, SamplingParams(max_new_tokens=12)))
    w.submit(Request("b", ids[:7], SamplingParams(max_new_tokens=6)))  # two sequences in one batch, a shared prefix
    done = {r.rid: r.output_ids for r in w.run_until_idle()}
    cfg = resolve_model(model)
    assert done["a"] == dense_greedy(cfg, weights(model), ids, 12)
    assert done["b"] == dense_greedy(cfg, weights(model), ids[:7], 6)


def test_each_rank_holds_its_share_of_the_kv_heads(make_worker) -> None:
    one, two = make_worker(tp_size=1), make_worker(tp_size=2)
    ids = prompt(16, seed=5)
    for w in (one, two):
        w.submit(Request("r", ids, SamplingParams(max_new_tokens=1)))
        w.run_until_idle()
    assert [p.geometry.num_kv_heads for p in two.pools] == [1, 1]
    assert [p.geometry.head_start for p in two.pools] == [0, 1]
    assert all(p.allocator is two.pool.allocator for p in two.pools), "one page table"
    pages = one.export_request_kv(tokens=ids).pages
    assert torch.equal(pages, two.export_request_kv(tokens=ids).pages), "same pages on both workers"
    slots = one.pool.token_slots(pages)
    for layer in range(one.pool.geometry.num_layers):
        full = one.pool.read(layer, slots)
        for r, pool in enumerate(two.pools):
            part = pool.read(layer, slots)
            for mine, whole in ((part.k, full.k), (part.v, full.v)):  # NOTE: all-reduce order: float rounding only
                torch.testing.assert_close(mine, whole[:, r : r + 1], rtol=1e-4, atol=1e-5 * float(whole.abs().max()))


def test_tp_sizes_that_do_not_split_the_model_are_refused(make_worker) -> None:
    with pytest.raises((KvmoveError, ModelError, ValueError)):
        make_worker(tp_size=3)
    with pytest.raises(KvmoveError, match="tp_size must be >= 1"):
        make_worker(tp_size=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_bfloat16_workers_generate(make_worker, tp: int) -> None:
    w = make_worker("qwen3-moe-tiny", tp_size=tp, dtype=torch.bfloat16)
    w.submit(Request("r", prompt(9, seed=6), SamplingParams(max_new_tokens=5)))
    (done,) = w.run_until_idle()
    assert len(done.output_ids) == 5 and w.pool.geometry.dtype == torch.bfloat16
