"""Session ids are plain ``host:port``: anything shaped like a URL (request forgery) is refused before any request
leaves the server, and an allow-list restricts peers further. Checked on the parser and on live servers, with a
listening socket that must never see a connection."""

from __future__ import annotations

import socket
import threading

import pytest

from kvmove.migration.peers import PeerAddress, PeerPolicy, PeerRefusedError

SSRF_SHAPES = [
    "evil.example:80/admin",
    "127.0.0.1:{port}/kvmove/pull_kv#",
    "127.0.0.1:{port}?x=1",
    "127.0.0.1:{port}#frag",
    "user@127.0.0.1:{port}",
    "http://127.0.0.1:{port}",
    "127.0.0.1:{port}\r\nX-Injected: 1",
    "127.0.0.1 :{port}",
    "127.0.0.1:+{port}",
    "127.0.0.1:0",
    "127.0.0.1:65536",
    "127.0.0.1:{port}0000",
    "::1:{port}",
    "[::1%lo]:{port}",
    "%31%32%37.0.0.1:{port}",
    "127.0.0.1",
    ":{port}",
    "-bad-.example:{port}",
    "",
]


@pytest.mark.parametrize("session_id", ["127.0.0.1:30001", "localhost:1", "[::1]:65535", "node-7.cluster.local:8000"])
def test_plain_host_port_is_accepted(session_id: str) -> None:
    peer = PeerAddress.parse(session_id)
    assert peer.session_id == session_id.lower()
    assert str(peer.url("/kvmove/pull_kv")).endswith(f":{peer.port}/kvmove/pull_kv")


@pytest.mark.parametrize("shape", SSRF_SHAPES)
def test_url_shaped_session_ids_are_refused(shape: str) -> None:
    with pytest.raises(PeerRefusedError) as err:
        PeerAddress.parse(shape.format(port=30001))
    assert err.value.status == 403 and "session_id" in str(err.value)


def test_the_allow_list_admits_only_its_peers() -> None:
    policy = PeerPolicy.of(["127.0.0.1:30001", "[::1]:30002"])
    assert policy.check("127.0.0.1:30001").port == 30001 and policy.check("[::1]:30002").port == 30002
    with pytest.raises(PeerRefusedError, match="not in this server's --allowed-peers"):
        policy.check("127.0.0.1:30003")
    assert PeerPolicy().check("10.1.2.3:4").host == "10.1.2.3"  # no list: any valid address


class _Listener:
    """A TCP port that records every connection made to it (a forged request would land here)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def listener():
    lis = _Listener()
    yield lis
    lis.close()


def test_servers_send_nothing_to_a_forged_session_id(pair, listener) -> None:
    httpx = pytest.importorskip("httpx")
    a, b = pair
    ids = list(range(1, 9))
    httpx.post(f"{a.url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    info = httpx.get(f"{b.url}/get_transfer_session_ids").json()["ranks"][0]
    target = {k: info[k] for k in ("tp", "pp", "host_kv_data_ptrs", "host_kv_item_lens")}
    for shape in SSRF_SHAPES[:8]:
        forged = shape.format(port=listener.port)
        transfer = {
            "input_ids": ids,
            "extra_token_size": 8,
            "target_per_rank": [{**target, "session_id": forged, "kv_indices": list(range(8))}],
        }
        r = httpx.post(f"{a.url}/transfer_request_kvcache", json=transfer, timeout=30)
        assert r.status_code == 403 and "session_id" in r.json()["message"], (forged, r.text)
        if not forged.startswith("http://"):  # NOTE: a release may name its target as http://host:port
            release = {"rid": "x", "migrated": True, "target": forged}
            r = httpx.post(f"{a.url}/kvmove/release_request", json=release)
            assert r.status_code == 403, (forged, r.text)
    assert listener.connections == 0, "a forged session id made the server connect somewhere"
    assert a.runtime.source.staged_pages == 0 and a.runtime.endpoint.outbox.used_pages == 0
    a.runtime.check_integrity()


def test_allowed_peers_restrict_transfers_pulls_and_hand_overs(start_server, pair, listener) -> None:
    httpx = pytest.importorskip("httpx")
    a, b = pair
    strict = start_server(transport=a.config.transport, allowed_peers=(b.config.session_id,))
    stranger = f"127.0.0.1:{listener.port}"
    ids = list(range(1, 9))
    httpx.post(f"{strict.url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    target = {"tp": 0, "pp": 0, "host_kv_data_ptrs": [0] * 8, "host_kv_item_lens": [512] * 8, "kv_indices": [0] * 8}
    body = {"input_ids": ids, "extra_token_size": 8, "target_per_rank": [{**target, "session_id": stranger}]}
    r = httpx.post(f"{strict.url}/transfer_request_kvcache", json=body, timeout=30)
    assert r.status_code == 403 and "--allowed-peers" in r.json()["message"]
    r = httpx.post(f"{strict.url}/kvmove/release_request", json={"rid": "x", "migrated": True, "target": stranger})
    assert r.status_code == 403 and "--allowed-peers" in r.json()["message"]
    source = {"session_id": stranger, "transport": "nixl", "endpoint": "e", "endpoint_info": "", "buffers": []}
    source |= {"geometry": info_geometry(a), "weight_version": "0"}
    sources = [{"tp": 0, "pp": 0, "src_pages": [0, 1], "endpoint": source}]
    pull = {"input_ids": ids, "matched_token_size": 0, "kv_indices": [0] * 8, "sources": sources, "checksum": ""}
    r = httpx.post(f"{strict.url}/kvmove/pull_kv", json=pull, timeout=30)
    assert r.status_code == 403 and "--allowed-peers" in r.json()["message"]
    assert listener.connections == 0
    strict.runtime.check_integrity()
    strict.stop()


def info_geometry(server) -> dict:
    from kvmove.migration.session import geometry_info

    return geometry_info(server.runtime.worker.pool.geometry).model_dump()
