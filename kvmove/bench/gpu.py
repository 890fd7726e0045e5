"""GPU benchmark suite (two CUDA GPUs, no Ray): ceilings, weight sync GPU 0 -> GPU 1, KV migration copies.

Run from the repository root on a machine with two GPUs:

    PYTHONPATH=. python -m kvmove.bench.gpu --out results --layers 8

1. Ceilings measured in the same run: peer-to-peer copy, NCCL send/recv, device copy, pinned and pageable
   host<->device copies (every later figure is a ratio to one of these).
2. Weight sync of a Qwen3-235B-A22B slice at full layer width (all 128 experts per layer, ``--layers`` decoder
   layers plus embedding and head): a trainer rank on cuda:0, an engine rank on cuda:1, strategies v1, v2, v3
   and broadcast, each in its own processes (their buffers never coexist), each sync verified region by region.
3. KV migration of Qwen3-235B-A22B-shaped KV (94 layers, 4 KV heads, head_dim 128): device pool (cuda:0) ->
   host pool -> host pool -> device pool (cuda:1), per prompt length.
Rows go to ``<out>/gpu.parquet`` labelled measured, with the GPU model as hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kvmove.bench.results import Labels, Row, append_rows, git_commit, versions

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines

GiB = 1 << 30


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up, synchronizing CUDA around each call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(name: str, nbytes: int, seconds: float) -> Row:
    return Row(kind="measured", suite="gpu", name=name, bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9)


def ceilings(nbytes: int = 2 * GiB, repeats: int = 5) -> list[Row]:
    rows = _copy_ceilings(nbytes, repeats)
    torch.cuda.empty_cache()
    rows.append(_row("ceiling nccl send/recv cuda:0->cuda:1", nbytes, _nccl_send_recv(nbytes, repeats)))
    return rows


def _copy_ceilings(nbytes: int, repeats: int) -> list[Row]:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    a2 = torch.empty_like(a)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    return [
        _row("ceiling p2p copy cuda:0->cuda:1", nbytes, _timed(lambda: b.copy_(a), repeats)),
        _row("ceiling device copy (read+write)", 2 * nbytes, _timed(lambda: a2.copy_(a), repeats)),
        _row("ceiling pinned H2D", nbytes, _timed(lambda: a.copy_(pinned, non_blocking=True), repeats)),
        _row("ceiling pinned D2H", nbytes, _timed(lambda: pinned.copy_(a, non_blocking=True), repeats)),
        _row("ceiling pageable H2D", nbytes, _timed(lambda: a.copy_(pageable), max(1, repeats // 2))),
    ]


def _nccl_peer(rank: int, port: int, nbytes: int, repeats: int, out: object) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    if rank == 1:
        out.put(statistics.median(times))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def _nccl_send_recv(nbytes: int, repeats: int) -> float:
    import torch.multiprocessing as mp

    from kvmove.sync.collectives import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_peer, args=(r, port, nbytes, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = float(out.get(timeout=600))
    for p in procs:
        p.join(60)
    return seconds


VARIANTS = "v1,v2,v3,v2:packed,v3:packed,broadcast"
"""Strategies to run; ``:packed`` turns direct pulls off (every region packed), so both are measured."""


def parse_variants(text: str) -> list[tuple[str, bool]]:
    """``"v3,v3:packed"`` -> [("v3", True), ("v3", False)]: (strategy, direct pulls)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, mode = item.partition(":")
        if mode not in ("", "packed", "direct"):
            raise SystemExit(f"unknown variant {item!r} (strategy[:packed|:direct])")
        out.append((name, mode != "packed"))
    return out


def weight_sync(
    layers: int,
    transports: list[str],
    syncs: int,
    say: Callable[[str], None],
    model: str = "qwen3-235b-a22b",
    devices: tuple[str, str] = ("cuda:0", "cuda:1"),
    record: Callable[[list[Row]], object] = lambda rows: None,
    variants: str = VARIANTS,
) -> list[Row]:
    from kvmove.bench.syncs import sync_row
    from kvmove.layout import EngineLayout, TrainerLayout
    from kvmove.models import model_totals, resolve_model
    from kvmove.sync.local import LocalConfig, run_local
    from kvmove.sync.schedule import SyncOptions
    from kvmove.sync.strategies import parse_strategies

    cfg = resolve_model(model, {"num_hidden_layers": layers})
    say(f"weight sync: {cfg.name} with {layers} layers, {model_totals(cfg).total_bytes / 1e9:.1f} GB per sync")
    rows = []
    for transport in transports:
        for strategy, direct in parse_variants(variants):
            if strategy == "broadcast" and transport != transports[0]:
                continue  # the baseline is one NCCL collective whatever the pull transport
            say(f"{transport} {strategy} ({'direct' if direct else 'packed'} pulls)")
            config = LocalConfig(
                model=cfg,
                trainer=TrainerLayout(),
                engine=EngineLayout(),
                strategies=tuple(parse_strategies(strategy)),
                transport=transport,
                syncs=syncs,
                verify=True,
                options=SyncOptions(group_size=1, lookahead=1, direct=direct),
                trainer_devices=(devices[0],),
                engine_devices=(devices[1],),
                deadline_s=150,
            )
            try:
                for r in run_local(config, progress=say):
                    head = f"  {transport} {r.strategy} sync {r.sync}: {r.seconds:.3f} s, {r.gbps:.1f} GB/s"
                    say(f"{head}, verified={r.verified}")
                    say(f"    phases {r.phases} peak extra {r.peak_extra_bytes} transfer {r.transfer_gbps:.1f} GB/s")
                    overrides = {"model_overrides": {"num_hidden_layers": layers}}  # the simulator rebuilds the slice
                    rows.append(sync_row(config, r, suite="gpu", extra=overrides))  # type: ignore[arg-type]
                    record(rows[-1:])  # NOTE: kept as it lands, so a later hang loses nothing
            except Exception as exc:  # one failed transport must not lose the others' rows
                say(f"  {transport} {strategy} FAILED: {type(exc).__name__}: {str(exc)[:2000]}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def kv_migration(
    prompt_lens: list[int],
    repeats: int,
    say: Callable[[str], None],
    devices: tuple[str, str] = ("cuda:0", "cuda:1"),
    layers: int = 94,
) -> list[Row]:
    from kvmove.kvcache import HostKVPool, KVGeometry, KVPool

    geo = KVGeometry(num_layers=layers, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16)
    pages = -(-max(prompt_lens) // geo.page_size)
    pinned = devices[0].startswith("cuda")
    src, dst = KVPool(geo, pages, device=devices[0]), KVPool(geo, pages, device=devices[1])
    host_a, host_b = HostKVPool(geo, pages, pin_memory=pinned), HostKVPool(geo, pages, pin_memory=pinned)
    for pool in (src, dst, host_a, host_b):
        pool.alloc(pages)  # a fresh allocator hands out 0..pages-1: each migration below is one run of pages
    for v in src.page_views():
        v.normal_()
    rows = []
    for tokens in prompt_lens:
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
            f"  KV {tokens} tokens ({nbytes / 1e9:.2f} GB): "
            + ", ".join(f"{k} {nbytes / v / 1e9:.1f} GB/s" for k, v in legs.items())
        )
        rows.append(
            Row(
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
                },
            )
        )
    return rows


def _host_copy(a: object, b: object, n: int) -> None:
    for x, y in zip(a._buffers, b._buffers, strict=True):  # type: ignore[attr-defined]
        y[:n].copy_(x[:n])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="kvmove GPU benchmark suite (2 GPUs)")
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--syncs", type=int, default=2)
    p.add_argument("--transports", default="cuda-ipc,nccl")
    p.add_argument("--prompt-lens", default="1024,4096,16384,32768")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: ceilings,sync,kv")
    p.add_argument("--variants", default=VARIANTS, help="strategies to sync, strategy[:packed], comma-separated")
    p.add_argument("--p2p-gbps", type=float, default=0.0, help="P2P ceiling of this run when ceilings are skipped")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("kvmove.bench.gpu needs two CUDA GPUs")

    def say(m: str) -> None:
        print(m, flush=True)

    name = torch.cuda.get_device_name(0).replace("NVIDIA ", "")
    labels = Labels(
        f"gpu:{name} x{torch.cuda.device_count()}", {**versions(), "cuda": str(torch.version.cuda)}, git_commit()
    )
    skip = set(filter(None, args.skip.split(",")))
    rows: list[Row] = []
    if "ceilings" not in skip:
        rows += ceilings()
        for r in rows:
            say(f"{r.name}: {r.gbps:.1f} GB/s")
        append_rows(args.out, "gpu", rows, labels)
    if "kv" not in skip:
        kv = kv_migration([int(x) for x in args.prompt_lens.split(",")], 3, say)
        append_rows(args.out, "gpu", kv, labels)
        rows += kv
    if "sync" not in skip:
        p2p = next((r.gbps for r in rows if r.name.startswith("ceiling p2p")), args.p2p_gbps)

        def record(new: list[Row]) -> None:  # every sync figure is held to the P2P copy measured in this run
            append_rows(args.out, "gpu", [dataclasses.replace(r, link_limit_gbps=p2p) for r in new], labels)

        transports = args.transports.split(",")
        rows += weight_sync(args.layers, transports, args.syncs, say, record=record, variants=args.variants)
    say(f"{len(rows)} rows -> {args.out / 'gpu.parquet'}")


if __name__ == "__main__":
    main()
