"""The CUDA copy executors (driver 1-D and 2-D copies; the batched Triton kernel) and cuda-ipc reads of strided
spans, on one GPU (trainer and engine ranks colocated: device-to-device copies) and, with two GPUs, across them;
skipped without CUDA (the kernel's tests also without triton)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from copy_cases import CASES, DST_SIZE, SRC_SIZE

from kvmove.transport.copies import copy_views, plan_copies, shifted

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N = 32 << 20


def _spans() -> np.ndarray:
    """A column block of a (4096, 4096) bf16 matrix (one 2-D copy), then loose 1-D spans."""
    r = np.arange(4096, dtype=np.int64)
    block = np.stack([r * 8192 + 4096, r * 4096, np.full(4096, 4096)], axis=1)
    loose = np.array([[N - 1000, 4096 * 4096, 1000], [5, 4096 * 4096 + 1000, 3]], dtype=np.int64)
    return np.concatenate([block, loose])


def _expected(src: torch.Tensor, size: int, spans: np.ndarray) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    host = src.cpu()
    for s, d, n in spans.tolist():
        out[d : d + n] = host[s : s + n]
    return out


def test_driver_runs_a_copy_plan_bit_exactly_inside_one_gpu() -> None:
    from kvmove.transport.cuda_driver import driver, run_plan

    drv = driver()
    assert drv is not None, "libcuda could not be loaded on a machine with a CUDA GPU"
    src = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(N, dtype=torch.uint8, device="cuda:0")
    spans = _spans()
    plan = plan_copies(spans)
    assert plan.ncopies == 3 and len(plan.strided) == 1
    stream = torch.cuda.current_stream(0)
    run_plan(drv, plan, src.data_ptr(), dst.data_ptr(), stream.cuda_stream, "test")
    stream.synchronize()
    assert torch.equal(dst.cpu(), _expected(src, N, spans))


@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernel_runs_a_copy_plan_bit_exactly(case: str) -> None:
    pytest.importorskip("triton")
    from kvmove.transport.tiling import plan_tiles
    from kvmove.transport.triton_copy import TritonTiles

    plan = plan_copies(CASES[case]())
    mem = torch.zeros(64 + SRC_SIZE + DST_SIZE, dtype=torch.uint8, device="cuda:0")
    src, dst = mem[64 : 64 + SRC_SIZE], mem[64 + SRC_SIZE :]
    src.copy_(torch.randint(0, 256, (SRC_SIZE,), dtype=torch.uint8, device="cuda:0"))
    want = torch.zeros_like(dst)
    copy_views(src, want, plan)
    for tile_bytes in (4096, 256 << 10):
        dst.zero_()
        TritonTiles(plan_tiles(shifted(plan, 64, 64 + SRC_SIZE), tile_bytes=tile_bytes), mem[:16]).run()
        torch.cuda.synchronize()
        assert torch.equal(dst, want), f"tiles of {tile_bytes} bytes"


@pytest.mark.parametrize(
    "source",
    ["cuda:0", pytest.param("cuda:1", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU"))],
)
def test_every_executor_moves_a_stage_to_tp_plan_bit_exactly(source: str) -> None:
    """The micro-check's plan (row-parallel halves of 128 experts' down projections, 1.3 GB): driver and kernel."""
    from kvmove.transport.copy_check import check
    from kvmove.transport.executors import triton_available

    rows = check(source, "cuda:0", repeats=1)
    assert all(r.equal for r in rows), rows
    names = {r.executor for r in rows}
    assert "driver" in names, names
    if triton_available():  # the rule sends the narrow rows to the kernel
        assert "triton" in names and any(n.startswith("assigned: triton") for n in names), names


def _serve(device: str, to_reader, from_reader) -> None:
    import faulthandler

    from kvmove.transport import get_transport

    faulthandler.dump_traceback_later(100, exit=True)  # a hung side says where, instead of timing the test out

    torch.cuda.set_device(torch.device(device))
    t = get_transport("cuda-ipc")()
    g = torch.Generator(device=device).manual_seed(11)
    arena = torch.randint(0, 256, (N,), dtype=torch.uint8, device=device, generator=g)
    desc = t.register(arena)  # before endpoint_info(): the info lists the buffers registered so far
    to_reader.put((t.endpoint_info(), desc))
    from_reader.get(timeout=120)
    t.close()


def _read(device: str, server: str, to_server, from_server, results) -> None:
    import faulthandler

    from kvmove.transport import get_transport
    from kvmove.transport.base import Read

    faulthandler.dump_traceback_later(100, exit=True)

    torch.cuda.set_device(torch.device(device))
    t = get_transport("cuda-ipc").open(device=device)
    info, remote = from_server.get(timeout=120)
    a = torch.zeros(N, dtype=torch.uint8, device=device)
    b = torch.zeros(4096, dtype=torch.uint8, device=device)
    da, db = t.register(a), t.register(b)
    t.connect(info)
    spans, small = _spans(), np.array([[100, 0, 4096]], dtype=np.int64)
    batch = [Read(remote, da, spans), Read(remote, db, small)]
    t.prepare(batch)
    for _ in range(3):  # the same batch every sync
        t.start_reads(batch).wait()
    want = torch.randint(
        0, 256, (N,), dtype=torch.uint8, device=server, generator=torch.Generator(device=server).manual_seed(11)
    )
    ok = torch.equal(a.cpu(), _expected(want, N, spans)) and torch.equal(b.cpu(), _expected(want, 4096, small))
    built_once = len(t._batches) == 1  # the batch's plan and executor were built at prepare, reused by every sync
    results.put(ok and built_once and set(t.take_executed()) <= {"driver", "triton"})
    t.close()
    to_server.put(None)


@pytest.mark.parametrize(
    ("server", "reader"),
    [
        ("cuda:0", "cuda:0"),
        pytest.param(
            "cuda:0",
            "cuda:1",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the peer case needs two GPUs"),
        ),
    ],
)
def test_cuda_ipc_batch_of_strided_reads_is_bit_exact(server: str, reader: str) -> None:
    ctx = mp.get_context("spawn")
    to_reader, to_server, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_serve, args=(server, to_reader, to_server)),
        ctx.Process(target=_read, args=(reader, server, to_server, to_reader, results)),
    ]
    for p in procs:
        p.start()
    try:
        assert results.get(timeout=110) is True
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
