"""The broadcast baseline's two halves: trainer rank 0 broadcasts every full tensor; engine ranks receive the
whole model, then run their own loader over it (each keeps its slice and drops the rest)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from kvmove.engines import EngineAdapter
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import hf_tensors
from kvmove.sync.engine import EngineStats
from kvmove.sync.source import ShardedSource
from kvmove.sync.trainer import TrainerStats


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).view(-1)


def send_all(source: ShardedSource, pg: Any | None) -> TrainerStats:
    """Every trainer rank gathers each tensor onto rank 0 (collective); rank 0 (``pg`` set) broadcasts it."""
    start = time.perf_counter()
    calls0 = source.coll.collective_calls
    gather = send = 0.0
    sent = peak = 0
    for meta in hf_tensors(source.cfg):
        t0 = time.perf_counter()
        (_, full), *_ = source.materialize([meta.name], "root")
        gather += time.perf_counter() - t0
        if pg is not None and full is not None:
            t1 = time.perf_counter()
            pg.broadcast(_flat(full), 0).wait()
            if full.is_cuda:
                torch.cuda.current_stream(full.device).synchronize()
            send += time.perf_counter() - t1
            sent += meta.nbytes
            peak = max(peak, meta.nbytes)
    return TrainerStats(
        source.rank,
        time.perf_counter() - start,
        gather,
        0.0,
        send,
        sent,
        0,
        peak,
        source.coll.collective_calls - calls0,
    )


def receive_all(
    cfg: ModelConfig, pg: Any, adapter: EngineAdapter, model: nn.Module, rank: int, device: str = "cpu"
) -> EngineStats:
    """Receive every full tensor (the whole model is materialized here), then load it with the engine's loader."""
    start = time.perf_counter()
    received: list[tuple[str, torch.Tensor]] = []
    transfer = 0.0
    for meta in hf_tensors(cfg):
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        t0 = time.perf_counter()
        pg.broadcast(_flat(buf), 0).wait()
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        transfer += time.perf_counter() - t0
        received.append((meta.name, buf))
    t1 = time.perf_counter()
    adapter.load_weights(model, received)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    load = time.perf_counter() - t1
    total = sum(t.numel() * t.element_size() for _, t in received)
    return EngineStats(rank, time.perf_counter() - start, 0.0, transfer, load, total, len(received), total)
