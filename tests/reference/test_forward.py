"""The paged forward pass equals a plain dense recomputation (HF names, no cache), chunk by chunk and token by token."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import dense_greedy, dense_logits, prompt, weights

from kvmove.errors import ModelError
from kvmove.kvcache import KVGeometry, KVPool
from kvmove.models import resolve_model
from kvmove.reference import Request, SamplingParams, build_model
from kvmove.reference.forward import ForwardBatch, SeqSpan, forward

MODELS = ["qwen3-tiny", "qwen3-moe-tiny", "qwen2-tiny"]


def _close(paged: torch.Tensor, dense: torch.Tensor) -> None:
    scale = float(dense.abs().max())
    torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("model", MODELS)
def test_paged_chunks_and_decode_match_dense_logits(model: str) -> None:
    cfg = resolve_model(model)
    hf = weights(model)
    m = build_model(cfg, hf.items(), torch.float32)
    page = 4
    pool = KVPool(KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, page, torch.float32), 16)
    pages = pool.alloc(16)[torch.randperm(16, generator=torch.Generator().manual_seed(0))][:6]  # scattered pages
    slots = pool.token_slots(pages)
    ids = prompt(21, seed=3)
    dense = dense_logits(cfg, hf, ids)
    start = 0
    for n in (7, 5, 1, 1, 4, 1, 1, 1):  # prefill, an extend over cached KV, decodes, another extend
        end = start + n
        batch = ForwardBatch(
            torch.tensor(ids[start:end]),
            torch.arange(start, end),
            slots[start:end],
            (SeqSpan(0, n, slots[:end]),),
        )
        _close(forward(m, pool, batch)[0], dense[end - 1])
        start = end
    assert start == len(ids)


def test_two_sequences_in_one_batch_match_dense() -> None:
    cfg = resolve_model("qwen3-moe-tiny")
    hf = weights("qwen3-moe-tiny")
    m = build_model(cfg, hf.items(), torch.float32)
    pool = KVPool(KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, torch.float32), 8)
    a, b = prompt(9, seed=1), prompt(5, seed=2)
    sa, sb = pool.token_slots(pool.alloc(3))[:9], pool.token_slots(pool.alloc(2))[:5]
    batch = ForwardBatch(
        torch.tensor(a + b),
        torch.cat([torch.arange(9), torch.arange(5)]),
        torch.cat([sa, sb]),
        (SeqSpan(0, 9, sa), SeqSpan(9, 5, sb)),
    )
    logits = forward(m, pool, batch)
    _close(logits[0], dense_logits(cfg, hf, a)[-1])
    _close(logits[1], dense_logits(cfg, hf, b)[-1])


@pytest.mark.parametrize("model", MODELS)
def test_worker_greedy_matches_dense_greedy(model: str, make_worker) -> None:
    w = make_worker(model)
    ids = prompt(11, seed=5)
    w.submit(Request("r", ids, SamplingParams(max_new_tokens=10)))
    (done,) = w.run_until_idle()
    assert done.output_ids == dense_greedy(resolve_model(model), weights(model), ids, 10)


def test_greedy_is_deterministic_across_workers(make_worker) -> None:
    outs = []
    for _ in range(2):
        w = make_worker("qwen3-moe-tiny")
        w.submit(Request("r", prompt(13, seed=9), SamplingParams(max_new_tokens=12)))
        outs.append(w.run_until_idle()[0].output_ids)
    assert outs[0] == outs[1]
    assert len(set(outs[0])) > 1, "the seeded model does not just repeat one token"


def test_architectures_without_a_forward_pass_are_refused() -> None:
    cfg = resolve_model("kimi-k2-tiny")
    with pytest.raises(ModelError, match="not DeepseekV3ForCausalLM"):
        build_model(cfg, weights("kimi-k2-tiny").items(), torch.float32)
