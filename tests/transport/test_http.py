"""The ``http`` transport in one process: wire format, grants (what a peer may read, and until when), bounds,
chunking and the reader's scatter, and real reads through its loopback server."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from byte_ranges import NBYTES, expected_after, random_ranges, seeded_bytes

from kvmove.transport import TRANSPORTS, TransportError
from kvmove.transport.http import HttpTransport, _chunks, _Scatter
from kvmove.transport.http_route import ReadRefused, ReadRequest

if not TRANSPORTS["http"].is_available():
    pytest.skip("the http transport needs the serve extra (pip install 'kvmove[serve]')", allow_module_level=True)


@pytest.fixture
def server():
    """An endpoint with one registered buffer of seeded bytes; served in-process (no web server unless asked)."""
    t = HttpTransport(url="http://127.0.0.1:9")  # NOTE: a url: serve() is called directly, nothing listens
    desc = t.register(seeded_bytes())
    yield t, desc
    t.close()


def _body(t: HttpTransport, grant: str, spans: list[tuple[int, int]], buffer_id: int = 0) -> bytes:
    return ReadRequest(t.endpoint, buffer_id, grant, np.array(spans, dtype=np.int64).reshape(-1, 2)).to_json()


def _grant_of(info) -> str:
    return json.loads(info.payload)["grant"]


def _answer(t: HttpTransport, body: bytes) -> bytes:
    answer = t.serve(body)
    data = b"".join(bytes(c) for c in answer.chunks)
    assert len(data) == answer.nbytes
    return data


def test_request_round_trips_and_drops_empty_spans():
    req = ReadRequest("e", 2, "g", np.array([[0, 4], [9, 0], [16, 8]], dtype=np.int64))
    back = ReadRequest.parse(req.to_json())
    assert (back.endpoint, back.buffer_id, back.grant) == ("e", 2, "g")
    assert back.spans.tolist() == [[0, 4], [16, 8]]


def test_endpoint_info_grants_every_buffer_whole(server):
    t, _ = server
    grant = _grant_of(t.endpoint_info())
    assert _answer(t, _body(t, grant, [(5, 3), (0, 2)])) == bytes(seeded_bytes()[[5, 6, 7, 0, 1]].tolist())
    assert t.open_grants == 0, "the endpoint-wide grant is not a transfer's"


def test_a_grant_allows_only_its_spans_until_revoked(server):
    t, _ = server
    info = t.grant({0: [(4096, 4096), (0, 1024), (1024, 1024)]})  # adjacent spans merge: [0, 2048) and [4096, 8192)
    grant = _grant_of(info)
    assert _answer(t, _body(t, grant, [(0, 2048), (5000, 100)])) == bytes(
        torch.cat([seeded_bytes()[:2048], seeded_bytes()[5000:5100]]).tolist()
    )
    for spans in ([(2000, 100)], [(2048, 1)], [(8190, 4)], [(0, 1), (3000, 1)]):
        with pytest.raises(ReadRefused, match="outside what the read grant allows") as err:
            t.serve(_body(t, grant, spans))
        assert err.value.status == 403
    assert t.open_grants == 1
    t.revoke(info)
    t.revoke(info)  # idempotent
    with pytest.raises(ReadRefused, match="unknown or was revoked"):
        t.serve(_body(t, grant, [(0, 8)]))
    assert t.open_grants == 0


def test_no_byte_leaves_after_revoke(server):
    t, _ = server
    info = t.grant({0: [(0, NBYTES)]})
    answer = t.serve(_body(t, _grant_of(info), [(0, NBYTES)]))  # checked, not yet copied
    t.revoke(info)
    with pytest.raises(TransportError, match="revoked during the read"):
        next(iter(answer.chunks))


@pytest.mark.parametrize(
    ("spans", "status", "message"),
    [
        ([(NBYTES - 4, 8)], 400, "past the 1048576-byte buffer"),
        ([(1 << 62, 1 << 62)], 400, "past the"),
    ],
)
def test_spans_are_bounds_checked(server, spans, status, message):
    t, _ = server
    with pytest.raises(ReadRefused, match=message) as err:
        t.serve(_body(t, _grant_of(t.endpoint_info()), spans))
    assert err.value.status == status


def test_only_registered_buffers_of_this_endpoint_are_served(server):
    t, _ = server
    grant = _grant_of(t.endpoint_info())
    with pytest.raises(ReadRefused, match="buffer 1 is not registered") as err:
        t.serve(_body(t, grant, [(0, 8)], buffer_id=1))
    assert err.value.status == 404
    other = ReadRequest("http-elsewhere", 0, grant, np.array([[0, 8]])).to_json()
    with pytest.raises(ReadRefused, match="not served here"):
        t.serve(other)
    with pytest.raises(TransportError, match="not registered"):
        t.grant({1: [(0, 8)]})
    with pytest.raises(TransportError, match="within the 1048576-byte buffer"):
        t.grant({0: [(NBYTES, 1)]})


@pytest.mark.parametrize(
    ("spans", "limit", "groups"),
    [
        ([(0, 10)], 4, [[(0, 4)], [(4, 4)], [(8, 2)]]),
        ([(0, 2), (10, 2), (20, 3)], 4, [[(0, 2), (10, 2)], [(20, 3)]]),
        ([(0, 3), (10, 3)], 4, [[(0, 3), (10, 1)], [(11, 2)]]),
        ([], 4, []),
    ],
)
def test_chunks(spans, limit, groups):
    assert list(_chunks(np.array(spans, dtype=np.int64).reshape(-1, 2), limit)) == groups


def test_scatter_lays_a_stream_into_the_local_spans_and_nothing_else():
    local = np.zeros(16, dtype=np.uint8)
    sink = _Scatter(local, np.array([[8, 3], [0, 2]]))
    for chunk in (b"\x01", b"\x02\x03\x04", b"\x05"):
        sink.write(chunk)
    sink.finish()
    assert local.tolist() == [4, 5, 0, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 0]
    with pytest.raises(TransportError, match="more bytes than the spans"):
        sink.write(b"\x06")
    short = _Scatter(local, np.array([[0, 4]]))
    short.write(b"\x01")
    with pytest.raises(TransportError, match="ended after 0 of 1 spans"):
        short.finish()


def test_reads_through_the_loopback_server_are_bit_exact():
    serving, reading = HttpTransport(), HttpTransport()
    remote = serving.register(seeded_bytes())
    buf = torch.zeros(NBYTES, dtype=torch.uint8)
    local = reading.register(buf)
    try:
        reading.connect(serving.endpoint_info())
        for seed in (1, 2):
            ranges = random_ranges(seed)
            buf.zero_()
            stats = reading.read(remote, local, ranges)
            assert torch.equal(buf, expected_after(ranges, seeded_bytes()))
            assert stats.bytes == sum(n for _, _, n in ranges)
        narrow = serving.grant({0: [(0, 64)]})
        reading.connect(narrow)  # the same peer, now holding a one-transfer grant
        reading.read(remote, local, [(0, 0, 64)])
        with pytest.raises(TransportError, match=r"refused the read \(403\).*outside what the read grant allows"):
            reading.read(remote, local, [(64, 0, 8)])
        serving.revoke(narrow)
        with pytest.raises(TransportError, match=r"\(403\).*revoked"):
            reading.read(remote, local, [(0, 0, 8)])
    finally:
        reading.close()
        serving.close()
