"""Every transport between two real Ray actors: bit-exact pulls, buffers registered once, clear errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from byte_ranges import NBYTES, expected_after, random_ranges, seeded_bytes

from kvmove.transport import TRANSPORTS, TransportError
from kvmove.transport.bandwidth import Peer, measure_bandwidth, pair_memberships
from kvmove.transport.slots import ACTOR_OPTIONS


def _skip_unless_available(name: str) -> None:
    if not TRANSPORTS[name].is_available():
        pytest.skip(f"{name}: its package is not installed here (pip install 'kvmove[{TRANSPORTS[name].extra}]')")


CUDA_ONLY = {"nccl", "cuda-ipc"}  # device-memory transports: tests/transport/test_cuda.py (gpu marker)


@pytest.fixture(scope="module", params=[name for name in TRANSPORTS if name not in CUDA_ONLY])
def pair(request, ray_session):
    """A server actor (seeded bytes) and a client actor (zeros), connected once, shared by this module."""
    name = request.param
    _skip_unless_available(name)
    ray = ray_session
    options = pair_memberships(name)
    actor_cls = ray.remote(num_cpus=0, **ACTOR_OPTIONS)(Peer)
    server = actor_cls.remote(name, NBYTES, 0, options[0])
    client = actor_cls.remote(name, NBYTES, None, options[1])
    if TRANSPORTS[name].actor_group:
        from kvmove.transport.rdt import create_rdt_group

        create_rdt_group([server, client], TRANSPORTS[name].actor_group)
    info, remote = ray.get(server.info.remote())
    ray.get(client.connect.remote(info))
    yield name, server, client, remote
    ray.get([server.close.remote(), client.close.remote()])
    for actor in (server, client):
        ray.kill(actor)


def test_pulls_are_bit_exact_and_reuse_registered_buffers(pair, ray_session):
    name, server, client, remote = pair
    ray, source = ray_session, seeded_bytes()
    for seed in (1, 2, 3):
        ranges = random_ranges(seed)
        stats = ray.get(client.read.remote(remote, ranges))
        got = ray.get(client.contents.remote())
        # only the pulled ranges are compared: earlier reads may have written elsewhere
        expected = expected_after(ranges, source)
        for _ro, lo, n in ranges:
            assert torch.equal(got[lo : lo + n], expected[lo : lo + n]), f"{name}: bytes differ at {lo}"
        assert stats.bytes == sum(n for _, _, n in ranges)
        assert stats.seconds > 0
    assert ray.get([server.registrations.remote(), client.registrations.remote()]) == [1, 1]


def test_whole_buffer_pull(pair, ray_session):
    _name, _server, client, remote = pair
    ray_session.get(client.read.remote(remote, [(0, 0, NBYTES)]))
    assert torch.equal(ray_session.get(client.contents.remote()), seeded_bytes())


def test_range_out_of_bounds_is_refused(pair, ray_session):
    _name, _server, client, remote = pair
    with pytest.raises(TransportError, match="past the 1048576-byte remote buffer"):
        ray_session.get(client.read.remote(remote, [(NBYTES - 4, 0, 8)]))


def test_unregistered_buffers_are_refused(pair, ray_session):
    _name, _server, client, remote = pair
    with pytest.raises(TransportError, match="never connected"):
        ray_session.get(client.read.remote(replace(remote, endpoint="someone-else"), [(0, 0, 8)]))
    if _name != "nixl":  # NIXL itself refuses unregistered remote memory below; the others ask the server
        with pytest.raises(TransportError, match="buffer 7 is not registered"):
            ray_session.get(client.read.remote(replace(remote, buffer_id=7), [(0, 0, 8)]))


def test_registering_twice_is_refused():
    from kvmove.transport.object_store import ObjectStoreTransport

    transport = ObjectStoreTransport()
    buf = torch.zeros(16, dtype=torch.uint8)
    transport.register(buf)
    with pytest.raises(TransportError, match="already registered"):
        transport.register(buf)
    with pytest.raises(TransportError, match="contiguous 1-D uint8"):
        transport.register(torch.zeros(4, dtype=torch.float32))
    transport.close()


def test_measure_bandwidth_between_actors(ray_session):
    name = "gloo"  # the process plumbing is shared by every transport; one is enough here
    _skip_unless_available(name)
    result = measure_bandwidth(name, 4 << 20, repeats=2)
    assert result.transport == name and result.processes == "ray" and result.gb_per_s > 0


def test_measure_concurrent_pairs(ray_session):
    from kvmove.transport.bandwidth import measure_concurrent

    c = measure_concurrent("object-store", 1 << 20, pairs=2, repeats=2)
    assert c.pairs == 2 and c.per_reader_gb_per_s > 0
    assert c.aggregate_gb_per_s >= c.per_reader_gb_per_s
    with pytest.raises(TransportError, match="one pair at a time"):
        measure_concurrent("gloo", 1 << 20, pairs=2)
