"""Micro-benchmarks that measure simulator costs no sync row measures yet (no Ray needed).

Run on the GPU machine (two GPUs): ``kvmove bench run --suite micro --results results/``.

- ``fp8 block quantize``: BF16 -> FP8 e4m3 with one FP32 scale per 128x128 tile (DeepSeek-V3's checkpoint
  format) by a pure-torch reference quantizer, bytes read plus written per second (not the sync's quantizer:
  the simulator prices quantization from FP8 sync rows, ``kvmove bench run --suite gpu-fp8``, and takes nothing
  from this row);
- ``nccl all_gather 4 KiB``: median latency of one small all-gather between two ranks (``collective_s``).
On a machine without CUDA the same code runs on CPU (gloo for the collective): rows then say ``cpu:...`` and
the simulator does not take costs from them. With ``--results DIR`` rows go to ``DIR/micro.parquet`` (measured).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import NamedTuple

import torch

from kvmove.bench.results import Labels, Row, git_commit, hardware_label, versions
from kvmove.quant.fp8 import FP8_MAX


class Quantized(NamedTuple):
    """FP8 e4m3 values and their FP32 scales, one per tile."""

    values: torch.Tensor
    scales: torch.Tensor


def quantize_blocks(x: torch.Tensor, block: int = 128) -> Quantized:
    """(FP8 e4m3 values, FP32 scales per ``block`` x ``block`` tile) of a 2-D BF16 tensor whose sides divide."""
    rows, cols = x.shape
    tiles = x.view(rows // block, block, cols // block, block).float()
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (tiles / scale).to(torch.float8_e4m3fn)
    return Quantized(q.view(rows, cols), scale.view(rows // block, cols // block))


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = q.shape
    tiles = q.view(rows // block, block, cols // block, block).float()
    return (tiles * scale.view(rows // block, 1, cols // block, 1)).view(rows, cols)


def _timed(fn: object, repeats: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # type: ignore[operator]
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def quantize_row(side: int, repeats: int, device: torch.device) -> Row:
    x = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    seconds = _timed(lambda: quantize_blocks(x), repeats, device)
    moved = side * side * 3 + (side // 128) ** 2 * 4  # read BF16, write FP8 and the scales
    return Row(
        kind="measured",
        suite="micro",
        name="fp8 block quantize",
        bytes=moved,
        seconds=seconds,
        gbps=moved / seconds / 1e9,
        extra={"shape": [side, side], "block": 128, "repeats": repeats},
    )


def _gather_peer(rank: int, port: int, nbytes: int, repeats: int, out: object, backend: str) -> None:
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = torch.zeros(nbytes // 2, dtype=torch.uint8, device=device)
    both = [torch.empty_like(mine) for _ in range(2)]
    times = []
    for i in range(repeats + 5):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dist.all_gather(both, mine)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def all_gather_row(nbytes: int, repeats: int, backend: str) -> Row:
    import torch.multiprocessing as mp

    from kvmove.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_peer, args=(r, port, nbytes, repeats, out, backend)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = float(out.get(timeout=300))
    for p in procs:
        p.join(60)
    name = f"{backend} all_gather {nbytes // 1024} KiB"
    return Row(kind="measured", suite="micro", name=name, bytes=nbytes, seconds=seconds,
               gbps=nbytes / seconds / 1e9, extra={"ranks": 2, "repeats": repeats, "backend": backend})  # fmt: skip


def device() -> torch.device:
    """Where the micro-benchmarks run: the first GPU, or the CPU without one."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def micro_rows(side: int | None = None, repeats: int = 10, gather: bool = True) -> list[Row]:
    """Measure and return the rows: a ``side`` x ``side`` block quantization (16384 on a GPU; 1024 on the CPU,
    whose rows the simulator takes no cost from) and, with ``gather``, the small all-gather between two ranks."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    here = device()
    cuda = here.type == "cuda"
    rows = [quantize_row(side or (16384 if cuda else 1024), repeats, here)]
    if gather:
        two_gpus = cuda and torch.cuda.device_count() >= 2
        rows.append(all_gather_row(4096, repeats * 10, "nccl" if two_gpus else "gloo"))
    return rows


def micro_labels() -> Labels:
    """The labels of this machine's micro rows (the GPU's, or ``cpu:...``)."""
    return Labels(hardware_label(str(device())), versions(), git_commit())
