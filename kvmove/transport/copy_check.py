"""Micro-check of the CUDA copy executors on a pipeline-stage -> tensor-parallel shaped plan (GPU, < 1 minute).

``kvmove check copy`` builds what an engine tp=2 rank reads from a pp=2 trainer's arena for one MoE layer's down
projections: each expert's ``(4096, 1536)`` bf16 matrix split on its columns, so 4096 rows of 1536 bytes at a
3072-byte pitch per expert (128 experts: 0.8 GB in narrow rows), plus whole-tensor 1-D copies (0.5 GB). Each
executor of ``kvmove.transport.executors`` runs it inside one GPU (and, with two GPUs, from the other one: a peer
read), and so does the split the executor rule makes (what cuda-ipc runs), each checked equal to torch's strided
copies and timed over a few runs; a plain contiguous device copy of as many bytes is the ceiling. Prints one line
each, then ``all_equal``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from kvmove.transport.copies import CopyPlan, copy_views, plan_copies, shifted
from kvmove.transport.executors import COPY_EXECUTORS, CopyExecutor, assign_executors

EXPERTS, ROWS, ROW_BYTES = 128, 4096, 3072
WHOLE, WHOLE_BYTES = 16, 32 << 20


class CheckRow(NamedTuple):
    executor: str
    """An executor running the whole plan, ``assigned`` (the split ``assign_executors`` makes, as cuda-ipc runs
    it) or the ceiling."""
    where: str
    nbytes: int
    seconds: float
    equal: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Spans(NamedTuple):
    """Copy spans (src, dst, nbytes) and the bytes of the source and destination buffers."""

    spans: np.ndarray
    src_bytes: int
    dst_bytes: int


def stage_to_tp_spans() -> Spans:
    """Spans (src, dst, nbytes), source bytes, destination bytes."""
    half = ROW_BYTES // 2
    r = np.arange(EXPERTS * ROWS, dtype=np.int64)
    narrow = np.stack([r * ROW_BYTES + half, r * half, np.full(len(r), half)], axis=1)
    src0, dst0 = EXPERTS * ROWS * ROW_BYTES, EXPERTS * ROWS * half
    k = np.arange(WHOLE, dtype=np.int64)
    whole = np.stack([src0 + k * WHOLE_BYTES, dst0 + k * WHOLE_BYTES, np.full(WHOLE, WHOLE_BYTES)], axis=1)
    return Spans(np.concatenate([narrow, whole]), src0 + WHOLE * WHOLE_BYTES, dst0 + WHOLE * WHOLE_BYTES)


def _time(fn: Callable[[], object], stream: torch.cuda.Stream, repeats: int) -> float:
    fn()
    stream.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out)


def _run_all(parts: tuple[CopyExecutor, ...], stream: torch.cuda.Stream) -> None:
    for part in parts:
        part.run(stream)


def check(source: str = "cuda:0", reader: str = "cuda:0", repeats: int = 5) -> list[CheckRow]:
    """Every available executor (and the ceiling) on the stage -> tp plan from ``source`` into ``reader``."""
    spans, nsrc, ndst = stage_to_tp_spans()
    plan = plan_copies(spans)
    torch.cuda.set_device(reader)
    src = torch.randint(0, 256, (nsrc,), dtype=torch.uint8, device=source)
    dst = torch.zeros(ndst, dtype=torch.uint8, device=reader)
    torch.empty(1, dtype=torch.uint8, device=reader).copy_(src[:1])  # NOTE: enables peer access (as cuda-ipc does)
    want = torch.zeros_like(dst)
    stream = torch.cuda.current_stream(reader)
    copy_views(src, want, plan)
    base = torch.zeros(16, dtype=torch.uint8, device=reader)
    at = base.data_ptr()
    batch = shifted(plan, src.data_ptr() - at, dst.data_ptr() - at)
    peer = torch.device(source) != torch.device(reader)
    where = f"{source}->{reader}"
    runs: dict[str, tuple[CopyExecutor, ...]] = {
        name: (cls(batch, base, f"copy check {name}"),) for name, cls in COPY_EXECUTORS.items() if cls.is_available()
    }
    split = assign_executors(batch, peer)
    runs["assigned: " + " then ".join(f"{n} {p.nbytes / 1e9:.2f} GB" for n, p in split)] = tuple(
        COPY_EXECUTORS[n](p, base, f"copy check {n}") for n, p in split
    )
    rows = []
    for name, parts in runs.items():
        dst.zero_()
        seconds = _time(partial(_run_all, parts, stream), stream, repeats)
        rows.append(CheckRow(name, where, plan.nbytes, seconds, bool(torch.equal(dst, want))))
    flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=reader)
    seconds = _time(lambda: flat.copy_(src[: plan.nbytes]), stream, repeats)
    rows.append(CheckRow("ceiling (contiguous copy)", where, plan.nbytes, seconds, True))
    return rows


def plan_summary() -> str:
    spans, _, _ = stage_to_tp_spans()
    plan: CopyPlan = plan_copies(spans)
    return f"{len(spans)} spans -> {plan.ncopies} copies ({len(plan.strided)} 2-D), {plan.nbytes / 1e9:.2f} GB"
