"""``nixl``, ``gloo`` and ``http`` between two plain torch.multiprocessing processes (the GPU machine has no Ray)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from byte_ranges import NBYTES, expected_after, random_ranges, seeded_bytes

from kvmove.transport import TRANSPORTS, TransportError
from kvmove.transport.bandwidth import Peer, measure_bandwidth, pair_memberships

NAMES = ["nixl", "gloo", "http"]


def _server(name, options, to_client, to_server):
    peer = Peer(name, NBYTES, 0, options)
    to_client.put(peer.info())
    to_server.get()
    peer.close()


def _client(name, options, to_client, to_server, results):
    peer = Peer(name, NBYTES, None, options)
    try:
        info, remote = to_client.get()
        peer.connect(info)
        out = []
        for seed in (1, 2, 3):
            peer.buf.zero_()
            stats = peer.read(remote, random_ranges(seed))
            out.append((seed, stats, peer.contents().numpy()))  # numpy: pickled by value
        try:
            peer.read(remote, [(NBYTES - 1, 0, 2)])
        except TransportError as exc:
            out.append(str(exc))
        results.put((out, peer.registrations()))
    finally:
        to_server.put(True)
        peer.close()


@pytest.mark.parametrize("name", NAMES)
def test_bit_exact_between_processes(name):
    if not TRANSPORTS[name].is_available():
        pytest.skip(f"{name}: its package is not installed here (pip install 'kvmove[{TRANSPORTS[name].extra}]')")
    ctx = mp.get_context("spawn")
    options = pair_memberships(name)
    to_client, to_server, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_server, args=(name, options[0], to_client, to_server)),
        ctx.Process(target=_client, args=(name, options[1], to_client, to_server, results)),
    ]
    for p in procs:
        p.start()
    out, registrations = results.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    source = seeded_bytes()
    for seed, stats, got in out[:-1]:
        ranges = random_ranges(seed)
        assert torch.equal(torch.from_numpy(got), expected_after(ranges, source))
        assert stats.bytes == sum(n for _, _, n in ranges)
    assert "past the 1048576-byte remote buffer" in out[-1]
    assert registrations == 1
    assert all(p.exitcode == 0 for p in procs)


@pytest.mark.parametrize("name", ["gloo", "http"])
def test_measure_bandwidth_without_ray(name):
    if not TRANSPORTS[name].is_available():
        pytest.skip(f"{name}: its package is not installed here (pip install 'kvmove[{TRANSPORTS[name].extra}]')")
    result = measure_bandwidth(name, 4 << 20, repeats=2, processes="process")
    assert result.transport == name and result.processes == "process" and result.nbytes == 4 << 20
    assert result.gb_per_s > 0


def test_ray_only_transports_refuse_plain_processes():
    with pytest.raises(TransportError, match="needs Ray actors"):
        measure_bandwidth("object-store", 1024, processes="process")
