"""CUDA transports between two processes on two GPUs (cuda:0 serves, cuda:1 reads); skipped without them."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from kvmove.ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

N = 64 << 20


def _make(name: str, member: int, port: int):
    if name == "nccl":
        from kvmove.transport.nccl import NcclGroup, NcclTransport

        return NcclTransport(group=NcclGroup(member, 2, port=port, timeout_s=60), device=f"cuda:{member}")
    from kvmove.transport import get_transport

    return get_transport(name)()


def _member(name: str, member: int, port: int, to_peer, from_peer, results) -> None:
    torch.cuda.set_device(member)
    t = _make(name, member, port)
    g = torch.Generator(device=f"cuda:{member}").manual_seed(7)
    if member == 0:
        buf = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda:0", generator=g)
    else:
        buf = torch.zeros(N, dtype=torch.uint8, device="cuda:1")
    desc = t.register(buf)
    to_peer.put((t.endpoint_info(), desc))
    info, remote = from_peer.get(timeout=60)
    t.connect(info)
    if member == 1:
        ranges = [(0, 0, N // 2), (N // 2 + 7, N // 2, 1000), (N - 5, N - 5, 5)]
        for _ in range(3):  # several reads of the same registered buffers
            t.read(remote, desc, ranges)
        want = torch.randint(
            0, 256, (N,), dtype=torch.uint8, device="cuda:0", generator=torch.Generator(device="cuda:0").manual_seed(7)
        )
        expected = torch.zeros(N, dtype=torch.uint8)
        for ro, lo, n in ranges:
            expected[lo : lo + n] = want[ro : ro + n].cpu()
        results.put((bool(torch.equal(buf.cpu(), expected)), t.registrations))
        t.close()
    else:
        results.get(timeout=120)


@pytest.mark.parametrize("name", ["cuda-ipc", "nccl"])
def test_cuda_transport_bit_exact_between_gpus(name: str) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    a, b, results, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_member, args=(name, 0, port, a, b, done)),
        ctx.Process(target=_member, args=(name, 1, port, b, a, results)),
    ]
    for p in procs:
        p.start()
    ok, registrations = results.get(timeout=180)
    done.put(None)
    for p in procs:
        p.join(60)
    assert ok and registrations == 1
