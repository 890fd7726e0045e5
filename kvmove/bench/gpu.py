"""The GPU suite (``kvmove bench run --suite gpu``): link ceilings, a matrix of weight syncs, KV copies.

No Ray: the syncs run on the processes launcher (one process per rank), through ``run_syncs`` and ``sync_row``
like every other sync row. It runs on one GPU or more (``devices``). One run measures:
1. ceilings: device copy, pinned and pageable host<->device copies (GPU only) and, with two devices, peer-to-peer
   copy and send/recv (NCCL on GPUs, gloo on CPU);
2. the weight-sync matrix (``kvmove.bench.matrix``) of a Qwen3-235B-A22B slice at full layer width (all 128
   experts per layer, ``layers`` decoder layers plus embedding and head): every layout, placement, strategy and
   transport, every sync verified, and each cell's ceiling from the device-copy and P2P rates measured in step 1;
3. KV-migration copies of Qwen3-235B-A22B-shaped KV (94 layers, 4 KV heads, head_dim 128): device pool ->
   host pool -> host pool -> device pool, per prompt length.
On CPU devices the same code is its own CI twin (a tiny model, gloo/nixl, small buffers).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from kvmove.bench import matrix
from kvmove.bench.matrix import LAYOUTS, Layout, Rates
from kvmove.bench.results import Row
from kvmove.errors import KvmoveError
from kvmove.kvcache import HostKVPool, KVGeometry, KVPool

GiB = 1 << 30
Say = Callable[[str], None]
Record = Callable[[list[Row]], object]


@dataclass(frozen=True)
class GpuSuite:
    """What one run of the suite measures (the defaults are the 2x H200 run)."""

    model: str = "qwen3-235b-a22b"
    layers: int = 8
    syncs: int = 3
    transports: tuple[str, ...] = ("cuda-ipc", "nixl", "nccl")
    """Pull transports; one not installed here is not run (and said so)."""
    strategies: str = "v1,v2,v3,broadcast"
    """Strategies of every cell (the broadcast baseline only where ranks do not share devices)."""
    layouts: tuple[Layout, ...] = LAYOUTS
    devices: tuple[str, ...] = ("cuda:0", "cuda:1")
    """One device: every rank colocated on it; two: the disaggregated 1->1 cell too, and the P2P ceiling."""
    prompt_lens: tuple[int, ...] = (1024, 4096, 16384, 32768)
    kv_layers: int = 94
    ceiling_bytes: int = 2 * GiB
    parts: frozenset[str] = field(default_factory=lambda: frozenset({"ceilings", "sync", "kv"}))
    deadline_s: float = 150.0

    @classmethod
    def cpu_twin(cls) -> GpuSuite:
        """The same code path on CPU devices, small enough for CI."""
        return cls(
            model="qwen3-moe-tiny",
            layers=2,
            syncs=2,
            transports=("gloo", "nixl", "nccl"),
            devices=("cpu", "cpu"),
            prompt_lens=(64, 256),
            kv_layers=4,
            ceiling_bytes=16 << 20,
            deadline_s=60.0,
        )

    @property
    def cuda(self) -> bool:
        return all(d.startswith("cuda") for d in self.devices)


def gpu_suite(suite: GpuSuite, record: Record, say: Say) -> list[Row]:
    """Run ``suite`` (ceilings, then KV copies, then syncs); ``record`` gets each batch of rows as it lands."""
    if suite.cuda and torch.cuda.device_count() < len(suite.devices):
        raise KvmoveError(f"the gpu suite on {', '.join(suite.devices)} needs {len(suite.devices)} CUDA GPU(s)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
    rows: list[Row] = []
    if "ceilings" in suite.parts:
        rows += _recorded(record, ceilings(suite, say))
    if "kv" in suite.parts:
        rows += _recorded(record, kv_migration(suite, say))
    if "sync" in suite.parts:
        rows += matrix.weight_syncs(suite, rates(rows), record, say)
    return rows


def rates(ceiling_rows: list[Row]) -> Rates:
    """Copy rates of this run: inside a device (half the read+write figure) and over the P2P link (0: none)."""
    copy = next((r.gbps / 2 for r in ceiling_rows if r.name.startswith("ceiling device copy")), 0.0)
    p2p = next((r.gbps for r in ceiling_rows if r.name.startswith("ceiling p2p")), 0.0)
    if not copy:
        raise KvmoveError("the weight-sync matrix needs this run's device-copy ceiling: run the ceilings part too")
    return Rates(copy, p2p)


def _recorded(record: Record, rows: list[Row]) -> list[Row]:
    record(rows)
    return rows


# -- ceilings --------------------------------------------------------------------------------------------------
def _synchronize() -> None:
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up, synchronizing CUDA around each call."""
    fn()
    times = []
    for _ in range(repeats):
        _synchronize()
        t0 = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(name: str, nbytes: int, seconds: float) -> Row:
    return Row(kind="measured", suite="gpu", name=name, bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9)


def ceilings(suite: GpuSuite, say: Say, repeats: int = 5) -> list[Row]:
    """Copy ceilings (device copy; with two devices P2P copy and send/recv), and host<->device copies on GPUs."""
    n, d0, d1 = suite.ceiling_bytes, suite.devices[0], suite.devices[-1]
    rows = _copy_ceilings(suite, repeats)
    if suite.cuda:
        torch.cuda.empty_cache()
    backend = "nccl" if suite.cuda else "gloo"
    if _peers(suite):
        rows.append(_row(f"ceiling {backend} send/recv {d0}->{d1}", n, _send_recv((d0, d1), n, repeats)))
    else:
        say("one device: no peer-to-peer or send/recv ceiling (every rank is colocated on it)")
    for r in rows:
        say(f"{r.name}: {r.gbps:.1f} GB/s")
    return rows


def _peers(suite: GpuSuite) -> bool:
    """Whether the suite has two devices to copy between (one GPU named twice is one device: NCCL refuses two
    ranks of one communicator on it)."""
    return len(suite.devices) > 1 and not (suite.cuda and len(set(suite.devices)) == 1)


def _copy_ceilings(suite: GpuSuite, repeats: int) -> list[Row]:
    n, d0, d1 = suite.ceiling_bytes, suite.devices[0], suite.devices[-1]
    a = torch.empty(n, dtype=torch.uint8, device=d0)
    a2 = torch.empty_like(a)
    rows = [_row("ceiling device copy (read+write)", 2 * n, _timed(lambda: a2.copy_(a), repeats))]
    if _peers(suite):
        b = torch.empty(n, dtype=torch.uint8, device=d1)
        rows.insert(0, _row(f"ceiling p2p copy {d0}->{d1}", n, _timed(lambda: b.copy_(a), repeats)))
    if suite.cuda:
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.uint8)
        rows += [
            _row("ceiling pinned H2D", n, _timed(lambda: a.copy_(pinned, non_blocking=True), repeats)),
            _row("ceiling pinned D2H", n, _timed(lambda: pinned.copy_(a, non_blocking=True), repeats)),
            _row("ceiling pageable H2D", n, _timed(lambda: a.copy_(pageable), max(1, repeats // 2))),
        ]
    return rows


def _send_recv_peer(rank: int, devices: tuple[str, str], port: int, nbytes: int, repeats: int, out: object) -> None:
    import torch.distributed as dist

    device = devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        _synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        _synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    if rank == 1:
        out.put(statistics.median(times))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def _send_recv(devices: tuple[str, str], nbytes: int, repeats: int) -> float:
    import torch.multiprocessing as mp

    from kvmove.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_send_recv_peer, args=(r, devices, port, nbytes, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return float(out.get(timeout=600))
    finally:
        for p in procs:
            p.join(60)


# -- KV migration copies ---------------------------------------------------------------------------------------
def kv_migration(suite: GpuSuite, say: Say, repeats: int = 3) -> list[Row]:
    """Device -> host -> host -> device copies of Qwen3-235B-A22B-shaped KV, per prompt length."""
    geo = KVGeometry(num_layers=suite.kv_layers, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16)
    pages = -(-max(suite.prompt_lens) // geo.page_size)
    src, dst = KVPool(geo, pages, device=suite.devices[0]), KVPool(geo, pages, device=suite.devices[-1])
    host_a, host_b = HostKVPool(geo, pages, pin_memory=suite.cuda), HostKVPool(geo, pages, pin_memory=suite.cuda)
    for pool in (src, dst, host_a, host_b):
        pool.alloc(pages)  # a fresh allocator hands out 0..pages-1: each migration below is one run of pages
    for v in src.page_views():
        v.normal_()
    return [_kv_row(suite, geo, tokens, (src, dst, host_a, host_b), repeats, say) for tokens in suite.prompt_lens]


def _kv_row(
    suite: GpuSuite,
    geo: KVGeometry,
    tokens: int,
    pools: tuple[KVPool, KVPool, HostKVPool, HostKVPool],
    repeats: int,
    say: Say,
) -> Row:
    src, dst, host_a, host_b = pools
    n = -(-tokens // geo.page_size)
    ids = torch.arange(n)
    nbytes = n * geo.page_bytes * geo.num_buffers  # every K and V buffer of every layer
    legs = {
        "device->host": _timed(partial(host_a.write_back, src, ids, ids), repeats),
        "host->host": _timed(partial(_host_copy, host_a, host_b, n), repeats),
        "host->device": _timed(partial(host_b.load_back, dst, ids, ids), repeats),
    }
    ok = all(torch.equal(a[:n].cpu(), b[:n].cpu()) for a, b in zip(src.page_views(), dst.page_views(), strict=True))
    total = sum(legs.values())
    say(
        f"  KV {tokens} tokens ({nbytes / 1e9:.3f} GB): "
        + ", ".join(f"{k} {nbytes / v / 1e9:.1f} GB/s" for k, v in legs.items())
    )
    return Row(
        kind="measured",
        suite="gpu",
        name="kv migration copy",
        model="qwen3-235b-a22b",
        bytes=nbytes,
        seconds=total,
        gbps=nbytes / total / 1e9,
        phases=legs,
        extra={
            "prompt_tokens": tokens,
            "verified": ok,
            "leg_gbps": {k: nbytes / v / 1e9 for k, v in legs.items()},
            "page_size": geo.page_size,
            "layers": suite.kv_layers,
        },
    )


def _host_copy(a: HostKVPool, b: HostKVPool, n: int) -> None:
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        y[:n].copy_(x[:n])
