"""The shm transport (CPU, one host): registered buffers live in named shared memory, a peer reads their spans and
maps them in place (``Transport.mapped``: what an engine quantizes a trainer's arena from). Across processes it
is exercised by tests/sync/driver/test_fp8_sync.py (trainer and engine ranks in processes of their own)."""

from __future__ import annotations

import pytest
import torch
from byte_ranges import random_ranges, seeded_bytes

from kvmove.transport import TransportError, get_transport
from kvmove.transport.local import LocalTransport
from kvmove.transport.shm import ShmTransport


def test_shm_is_registered_and_maps_peers() -> None:
    assert get_transport("shm") is ShmTransport and ShmTransport.maps_peers and ShmTransport.is_available()


def test_a_registered_buffer_keeps_its_views_and_is_read_and_mapped_by_a_peer() -> None:
    server, client = ShmTransport(), ShmTransport()
    arena = seeded_bytes(1 << 16, seed=3)
    expected = arena.clone()
    shard = arena[4096:8192].view(torch.bfloat16)  # a view taken before registering (a source's shard views)
    remote = server.register(arena)
    assert arena.untyped_storage().is_shared() and torch.equal(arena, expected)
    recv = torch.zeros(1 << 16, dtype=torch.uint8)
    local = client.register(recv)
    client.connect(server.endpoint_info())
    ranges = random_ranges(7, nbytes=1 << 16)
    client.read(remote, local, ranges)
    want = torch.zeros_like(recv)
    for ro, lo, n in ranges:  # in order: a later range may overwrite a byte of an earlier one
        want[lo : lo + n] = expected[ro : ro + n]
    assert torch.equal(recv, want)
    mapped = client.mapped(remote)
    assert mapped.numel() == arena.numel() and torch.equal(mapped, arena)
    shard.fill_(1.5)  # the server writes through its old view: the peer's mapping sees it (one set of pages)
    assert torch.equal(mapped[4096:8192], arena[4096:8192]) and not torch.equal(mapped, expected)
    server.close()
    client.close()


def test_a_buffer_at_an_offset_of_its_storage_maps_as_itself() -> None:
    server, client = ShmTransport(), ShmTransport()
    whole = seeded_bytes(1 << 12, seed=5)
    part = whole[1000:3000]
    remote = server.register(part)
    client.connect(server.endpoint_info())
    assert torch.equal(client.mapped(remote), whole[1000:3000])


def test_mapping_is_refused_clearly() -> None:
    server, client = ShmTransport(), ShmTransport()
    remote = server.register(seeded_bytes(256))
    with pytest.raises(TransportError, match="never connected"):
        client.mapped(remote)

    class Unmapped(LocalTransport):
        maps_peers = False

    a, b = LocalTransport(), Unmapped()
    desc = a.register(seeded_bytes(256))
    b.connect(a.endpoint_info())
    with pytest.raises(TransportError, match="cannot map a peer's buffer"):
        b.mapped(desc)
    with pytest.raises(TransportError, match="CPU buffers only"):
        server.register(torch.empty(64, dtype=torch.uint8, device="meta"))


def test_local_maps_its_peers_buffer_itself() -> None:
    a, b = LocalTransport(), LocalTransport()
    buf = seeded_bytes(512)
    desc = a.register(buf)
    b.connect(a.endpoint_info())
    assert b.mapped(desc).data_ptr() == buf.data_ptr()
