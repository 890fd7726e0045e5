"""Model runner: turns a scheduled batch into one paged forward pass and samples one token per request.

A request whose sampling raises is reported in ``RunResult.failed`` instead of failing the batch; if the shared
forward pass itself raises, nothing has advanced and the caller may run the requests one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.kvcache import KVPool
from kvmove.reference.forward import ForwardBatch, SeqSpan, forward_ranks
from kvmove.reference.kv_manager import KVAllocation
from kvmove.reference.model import ReferenceModel
from kvmove.reference.request import Request
from kvmove.reference.scheduler import ScheduledBatch


class RunResult(NamedTuple):
    """One token per request that sampled (by rid), and the error of each request that raised while sampling."""

    tokens: dict[str, int]
    failed: dict[str, str]


class ModelRunner:
    """Runs the worker's tensor-parallel ranks together: ``models[r]`` with ``pools[r]`` (one page table)."""

    def __init__(self, models: Sequence[ReferenceModel], pools: Sequence[KVPool]) -> None:
        self.models, self.pools = list(models), list(pools)
        self.pool = self.pools[0]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, allocs: dict[str, KVAllocation]) -> RunResult:
        """Compute each request's tokens ``all_ids[kv_len:]``, advance ``kv_len``, sample one token each."""
        fb = self.prepare(batch.requests, allocs)
        logits = forward_ranks(self.models, self.pools, fb)
        for req, span in zip(batch.requests, fb.seqs, strict=True):
            req.kv_len += span.num_new
            req.computed_tokens += span.num_new
        result = RunResult({}, {})
        for req, row in zip(batch.requests, logits, strict=True):
            try:
                result.tokens[req.rid] = sample(req, row)
            except Exception as exc:  # NOTE: one request's sampling must not fail its batch
                result.failed[req.rid] = f"sampling failed: {exc!r}"
        return result

    def prepare(self, reqs: tuple[Request, ...], allocs: dict[str, KVAllocation]) -> ForwardBatch:
        ids, positions, out_slots, seqs = [], [], [], []
        offset = 0
        for req in reqs:
            start, end = req.kv_len, req.num_tokens
            slots = self.pool.token_slots(allocs[req.rid].pages)[:end]
            ids.append(torch.tensor(req.all_ids[start:end], dtype=torch.int64, device=slots.device))
            positions.append(torch.arange(start, end, dtype=torch.int64, device=slots.device))
            out_slots.append(slots[start:end])
            seqs.append(SeqSpan(offset, end - start, slots))
            offset += end - start
        return ForwardBatch(torch.cat(ids), torch.cat(positions), torch.cat(out_slots), tuple(seqs))


def sample(req: Request, logits: torch.Tensor) -> int:
    """Greedy argmax, or a draw from ``softmax(logits / temperature)`` with the request's own generator."""
    if req.sampling.greedy:
        return int(logits.argmax())
    probs = (logits.float().cpu() / req.sampling.temperature).softmax(dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"temperature {req.sampling.temperature} gives non-finite probabilities")
    return int(torch.multinomial(probs, 1, generator=req.sampler()))
