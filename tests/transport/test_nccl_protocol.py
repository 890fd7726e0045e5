"""The NCCL transport's pull protocol, run on CPU with the gloo backend between two real processes."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from kvmove.ports import free_port
from kvmove.transport.nccl import NcclGroup, NcclTransport

N = 1 << 16


def _member(member: int, port: int, to_peer, from_peer, results) -> None:
    t = NcclTransport(group=NcclGroup(member, 2, port=port, timeout_s=30), device="cpu", backend="gloo")
    buf = torch.arange(N, dtype=torch.int64).to(torch.uint8) if member == 0 else torch.zeros(N, dtype=torch.uint8)
    desc = t.register(buf)
    to_peer.put((t.endpoint_info(), desc))
    info, remote = from_peer.get(timeout=30)
    t.connect(info)
    if member == 1:
        ranges = [(100, 0, 1000), (5000, 2000, 3), (0, 10000, 4096)]
        stats = [t.read(remote, desc, ranges) for _ in range(2)]
        want = torch.zeros(N, dtype=torch.uint8)
        src = torch.arange(N, dtype=torch.int64).to(torch.uint8)
        for ro, lo, n in ranges:
            want[lo : lo + n] = src[ro : ro + n]
        results.put((bool(torch.equal(buf, want)), stats[0].bytes, t.registrations))
        t.close()
    else:
        results.get(timeout=60)  # wait until the reader is done before exiting (the serving thread answers it)


def test_pull_protocol_bit_exact_between_processes() -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    a_to_b, b_to_a, results, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_member, args=(0, port, a_to_b, b_to_a, done))
    reader = ctx.Process(target=_member, args=(1, port, b_to_a, a_to_b, results))
    server.start()
    reader.start()
    ok, nbytes, registrations = results.get(timeout=90)
    done.put(None)
    reader.join(30)
    server.join(30)
    assert ok and nbytes == 1000 + 3 + 4096 and registrations == 1
