"""Decode step latency of a loaded worker with and without migrations into it (p50/p99, measured).

The target worker decodes ``decoding`` long requests the whole time. Windows alternate: in a *free* window nothing
else happens; in a *migrating* window a controller moves cached prompts from the source into the target one after
another (allocate -> transfer -> commit, each pulled by the target while it decodes). The step log of the target's
decode loop gives every step's latency; windows alternate so that drift of a shared machine's load falls on both.

The source runs as its own ``kvmove serve`` process (``spawn_source``; a thread of this process for the CPU twin of
the tests), the target in this process (its step log is read directly); the controller is a thread of this process.
Prompts cycle through more than the target can cache, so each migration moves a whole prompt's pages.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvmove.bench.results import Row
from kvmove.errors import KvmoveError
from kvmove.migration import messages as m
from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import transfer_body
from kvmove.migration.endpoint import choose_transport
from kvmove.ports import free_port
from kvmove.server.config import ServerConfig
from kvmove.server.launch import LocalCluster, ServerThread
from kvmove.server.messages import AbortRequestReq, GenerateReq, SamplingParamsMsg


@dataclass(frozen=True)
class DecodeLatencyConfig:
    transport: str = "auto"
    model: str = "qwen3-tiny"
    decoding: int = 8  # requests decoding on the target the whole time
    prompt_tokens: int = 256  # tokens of K/V each migration moves
    prompts: int = 24  # distinct prompts cached on the source, migrated round robin
    rounds: int = 4  # pairs of (free, migrating) windows
    window_s: float = 1.0
    page_size: int = 16
    tp_size: int = 1
    spawn_source: bool = True


@dataclass
class _Windows:
    free: list[float]
    migrating: list[float]
    migrations: int = 0
    bytes: int = 0
    transfer_seconds: float = 0.0


Say = Callable[[str], None]


def decode_latency(cfg: DecodeLatencyConfig, say: Say = print) -> Row:
    """Run the benchmark once; one measured row (``extra`` holds p50/p99 of both conditions and their ratios)."""
    transport = choose_transport(cfg.transport).name
    prompt_pages = -(-cfg.prompt_tokens // cfg.page_size)
    new_tokens = 4096  # NOTE: decoders outlive the run (aborted at the end)
    decode_pages = cfg.decoding * -(-(16 + new_tokens) // cfg.page_size)
    base = ServerConfig(
        model=cfg.model,
        page_size=cfg.page_size,
        transport=transport,
        enable_kv_migration=True,
        max_prefill_tokens=max(2048, cfg.prompt_tokens + 1),
        max_running=cfg.decoding + 2,
        tp_size=cfg.tp_size,
    )
    source_cfg = replace(base, port=free_port(), num_pages=(cfg.prompts + 2) * prompt_pages)
    target_cfg = replace(base, port=free_port(), num_pages=decode_pages + (cfg.prompts // 3) * prompt_pages)
    with tempfile.TemporaryDirectory(prefix="kvmove-decode-latency-") as logs:
        source = _start_source(source_cfg, cfg.spawn_source, Path(logs))
        target = ServerThread(target_cfg).start()
        try:
            windows = _run(cfg, source.url, target, new_tokens, say)
        finally:
            target.stop()
            source.stop()
    return _row(cfg, transport, windows)


class _Source:
    def __init__(self, thread: ServerThread | None, cluster: LocalCluster | None, url: str) -> None:
        self.thread, self.cluster, self.url = thread, cluster, url

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        if self.cluster is not None:
            self.cluster.__exit__()


def _start_source(config: ServerConfig, spawn: bool, logs: Path) -> _Source:
    if spawn:
        cluster = LocalCluster([config], logs).__enter__()
        return _Source(None, cluster, config.url)
    return _Source(ServerThread(config).start(), None, config.url)


def _run(cfg: DecodeLatencyConfig, source_url: str, target: ServerThread, new_tokens: int, say: Say) -> _Windows:
    src, dst = WorkerClient(source_url, timeout=120), WorkerClient(target.url, timeout=120)
    prompts = [_tokens(cfg.prompt_tokens, 100 + i) for i in range(cfg.prompts)]
    for i, ids in enumerate(prompts):
        src.generate(GenerateReq(input_ids=ids, sampling_params=_greedy(1), extra_key=f"p{i}"))
    decoders = [_decode(dst, f"decoder{i}", new_tokens) for i in range(cfg.decoding)]
    deadline = time.monotonic() + 60
    while len(target.runtime.worker.scheduler.running) < cfg.decoding:
        if time.monotonic() > deadline:
            raise KvmoveError("the decoding requests were not all admitted on the target within 60 s")
        time.sleep(0.01)
    out = _Windows([], [])
    done: list[m.TransferRequestKVCacheResp] = []

    def migrate(stop: threading.Event) -> None:  # NOTE: prompts round robin, more than the target can cache
        while not stop.is_set():
            i = len(done) % len(prompts)
            done.append(_migrate(src, dst, prompts[i], f"p{i}"))

    for r in range(cfg.rounds):
        out.free += _decode_steps(target, cfg.window_s, lambda stop: None)
        before = len(done)
        out.migrating += _decode_steps(target, cfg.window_s, migrate)
        out.migrations += len(done) - before
        say(f"  round {r + 1}/{cfg.rounds}: {len(done) - before} migrations into the decoding worker")
    out.bytes, out.transfer_seconds = sum(d.bytes for d in done), sum(d.seconds for d in done)
    for i in range(cfg.decoding):
        target.runtime.abort_request(AbortRequestReq(rid=f"decoder{i}"))
    for t in decoders:
        t.join(timeout=60)
    target.runtime.check_integrity()
    src.close()
    dst.close()
    return out


def _decode_steps(target: ServerThread, seconds: float, background: Callable[[threading.Event], None]) -> list[float]:
    """Latencies of the target's decode steps during ``seconds``, while ``background(stop)`` runs in a thread."""
    stop = threading.Event()
    worker = threading.Thread(target=background, args=(stop,), daemon=True)
    start = time.perf_counter()
    worker.start()
    time.sleep(seconds)
    stop.set()
    end = time.perf_counter()
    worker.join(timeout=120)
    return [s.seconds for s in target.runtime.steps.between(start, end) if s.decode and not s.prefill_tokens]


def _migrate(src: WorkerClient, dst: WorkerClient, ids: list[int], key: str) -> m.TransferRequestKVCacheResp:
    size = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    alloc = dst.allocate(
        m.AllocateTokenForTransferReq(input_ids=ids, extra_key=key, extra_token_size=size.extra_token_size)
    )
    try:
        done = src.transfer(transfer_body(ids, key, size, dst.session_ids(), alloc))
        dst.commit(alloc.migration_id)
    except BaseException:
        dst.abort(alloc.migration_id)
        raise
    return done


def _decode(dst: WorkerClient, rid: str, n: int) -> threading.Thread:
    body = GenerateReq(input_ids=_tokens(16, hash(rid) % 1000), rid=rid, sampling_params=_greedy(n))
    t = threading.Thread(target=dst.generate, args=(body,), daemon=True)
    t.start()
    return t


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParamsMsg:
    return SamplingParamsMsg(max_new_tokens=n, temperature=0)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def _row(cfg: DecodeLatencyConfig, transport: str, w: _Windows) -> Row:
    if not w.free or not w.migrating:
        raise KvmoveError("no decode step was recorded in a window (the worker stopped decoding?)")
    p50_free, p50_mig = statistics.median(w.free), statistics.median(w.migrating)
    p99_free, p99_mig = _quantile(w.free, 0.99), _quantile(w.migrating, 0.99)
    return Row(
        kind="measured",
        suite="decode-latency",
        name="decode step with migrations into the worker",
        model=cfg.model,
        transport=transport,
        bytes=w.bytes,
        seconds=p50_mig,
        gbps=w.bytes / w.transfer_seconds / 1e9 if w.transfer_seconds > 0 else 0.0,
        extra={
            "decoding_requests": cfg.decoding,
            "prompt_tokens": cfg.prompt_tokens,
            "tp_size": cfg.tp_size,
            "rounds": cfg.rounds,
            "window_s": cfg.window_s,
            "migrations": w.migrations,
            "steps_free": len(w.free),
            "steps_migrating": len(w.migrating),
            "p50_free_s": p50_free,
            "p99_free_s": p99_free,
            "p50_migrating_s": p50_mig,
            "p99_migrating_s": p99_mig,
            "p50_ratio": p50_mig / p50_free,
            "p99_ratio": p99_mig / p99_free,
        },
    )
