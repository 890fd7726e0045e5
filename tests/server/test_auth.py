"""Who may call what: SGLang's --api-key/--admin-api-key semantics on every route, the reduced /metrics of an
unauthenticated caller, kvmove's migration routes absent without --enable-kv-migration, and peers presenting the
admin key to each other during a whole migration (both transports)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx
from server_fixtures import pause_after_decoding

from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import migrate_request, move_kv
from kvmove.server.auth import Access, ApiKeys, presented_key
from kvmove.server.messages import GenerateReq, GenerateResp, SamplingParamsMsg
from kvmove.transport.http_route import READ_PATH

API, ADMIN = "api-key-for-tests", "admin-key-for-tests"
IDS = list(range(1, 17))

ADMIN_ROUTES = [
    ("GET", "/get_transfer_session_ids"),
    ("POST", "/get_request_extra_token_size"),
    ("POST", "/allocate_token_for_transfer_request"),
    ("POST", "/transfer_request_kvcache"),
    ("POST", "/commit_transfer_request_kvcache"),
    ("POST", "/abort_transfer_request_kvcache"),
    ("POST", "/kvmove/pull_kv"),
    ("POST", READ_PATH),
    ("POST", "/kvmove/hold_request"),
    ("POST", "/kvmove/release_request"),
    ("POST", "/flush_cache"),
    ("GET", "/kvmove/integrity"),
    ("GET", "/kvmove/resources"),
]
NORMAL_ROUTES = [("POST", "/generate"), ("POST", "/tokenize"), ("POST", "/detokenize")]


@pytest.mark.parametrize(
    ("keys", "level", "presented", "allowed"),
    [
        (ApiKeys(), Access.ADMIN, None, True),  # no keys: open, as SGLang
        (ApiKeys(api_key="a"), Access.NORMAL, None, False),
        (ApiKeys(api_key="a"), Access.NORMAL, "a", True),
        (ApiKeys(api_key="a"), Access.ADMIN, "a", True),  # only an API key: it opens the admin routes too
        (ApiKeys(admin_api_key="b"), Access.NORMAL, None, True),  # only an admin key: normal routes stay open
        (ApiKeys(admin_api_key="b"), Access.ADMIN, None, False),
        (ApiKeys("a", "b"), Access.ADMIN, "a", False),  # both: the API key does not open admin routes
        (ApiKeys("a", "b"), Access.ADMIN, "b", True),
        (ApiKeys("a", "b"), Access.NORMAL, "b", True),  # the admin key opens normal routes (peers' hand-over)
        (ApiKeys("a", "b"), Access.NORMAL, "ab", False),
        (ApiKeys("a", "b"), Access.OPEN, None, True),
    ],
)
def test_sglang_access_levels(keys: ApiKeys, level: Access, presented: str | None, allowed: bool) -> None:
    assert keys.allows(level, presented) is allowed


def test_keys_are_read_from_bearer_or_x_api_key() -> None:
    assert presented_key({"authorization": "Bearer k1"}) == "k1"
    assert presented_key({"authorization": "bearer k2"}) == "k2"
    assert presented_key({"x-api-key": "k3"}) == "k3"
    assert presented_key({"authorization": "Basic k4"}) is None and presented_key({}) is None


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server(api_key=API, admin_api_key=ADMIN)


def _call(server, method: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.url}{path}", json={}, headers=headers, timeout=30)


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_need_the_admin_key(keyed, method: str, path: str) -> None:
    for key in (None, "wrong", API):
        r = _call(keyed, method, path, key)
        assert r.status_code == 401, (key, r.text)
        assert r.json()["success"] is False and "admin API key" in r.json()["message"]
    assert _call(keyed, method, path, ADMIN).status_code != 401  # past auth (the empty body may still be refused)
    keyed.runtime.check_integrity()


@pytest.mark.parametrize(("method", "path"), NORMAL_ROUTES)
def test_normal_routes_need_the_api_key(keyed, method: str, path: str) -> None:
    assert _call(keyed, method, path).status_code == 401
    assert _call(keyed, method, path, "wrong").status_code == 401
    assert _call(keyed, method, path, API).status_code == 400  # past auth: the empty body is refused
    assert _call(keyed, method, path, ADMIN).status_code == 400


def test_refused_before_the_body_is_read(keyed) -> None:
    """A refused caller learns nothing from validation, and its (oversized) body is never read."""
    big = httpx.post(f"{keyed.url}/generate", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert big.status_code == 401


def test_metrics_is_open_but_names_no_request_to_an_unauthenticated_caller(keyed, monkeypatch) -> None:
    body = GenerateReq(input_ids=IDS, rid="secret-rid", sampling_params=SamplingParamsMsg(max_new_tokens=20))
    client = WorkerClient(keyed.url, api_key=API)
    t = threading.Thread(target=client.generate, args=(body,))
    t.start()
    let_go = pause_after_decoding(monkeypatch, keyed, "secret-rid", tokens=1)  # NOTE: running while it is looked at
    try:
        for key in (None, API):
            for path in ("/metrics.json", "/metrics?format=json"):
                anon = _call(keyed, "GET", path, key)
                assert anon.status_code == 200 and anon.json()["rids_hidden"] is True
                assert "secret-rid" not in anon.text and anon.json()["running"] == 1
            text = _call(keyed, "GET", "/metrics", key)  # Prometheus text: counts only
            assert text.status_code == 200 and "kvmove_requests_running 1.0" in text.text
            assert "secret-rid" not in text.text
        admin = _call(keyed, "GET", "/metrics.json", ADMIN).json()
        assert admin["rids_hidden"] is False and admin["running_rids"] == ["secret-rid"]
        assert _call(keyed, "GET", "/health").status_code == 200
    finally:
        let_go()
        t.join(timeout=60)
        client.close()


MIGRATION_ROUTES = ADMIN_ROUTES[:10]
"""The routes that hand a request, its prompt or its K/V to their caller: the fork's five, kvmove's migration abort,
the data plane, the hold and the release."""


def test_only_an_api_key_guards_every_route_but_health_and_metrics(start_server) -> None:
    s = start_server(api_key=API, enable_kv_migration=False)
    for method, path in ADMIN_ROUTES[10:] + NORMAL_ROUTES[:1]:
        assert _call(s, method, path).status_code == 401
        assert _call(s, method, path, API).status_code != 401
    assert _call(s, "GET", "/metrics.json").json()["rids_hidden"] is True
    assert _call(s, "GET", "/metrics.json", API).json()["rids_hidden"] is False
    s.stop()


def test_with_only_an_api_key_the_migration_routes_refuse_it_by_default(start_server) -> None:
    """The secure default: with --enable-kv-migration and no --admin-api-key, a user key opens generation but no
    migration, hold or data-plane route (403 naming the flags), and /metrics lists no request id to it."""
    s = start_server(api_key=API)
    for method, path in MIGRATION_ROUTES:
        r = _call(s, method, path, API)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["success"] is False and "--admin-api-key" in r.json()["message"]
        assert "--allow-user-migration" in r.json()["message"]
        assert _call(s, method, path).status_code == 401
    for method, path in ADMIN_ROUTES[10:] + NORMAL_ROUTES[:1]:  # flush, integrity, resources, generation: as before
        assert _call(s, method, path, API).status_code not in (401, 403)
    assert _call(s, "GET", "/metrics.json", API).json()["rids_hidden"] is True
    s.stop()


def test_allow_user_migration_lets_the_api_key_migrate(start_server) -> None:
    """SGLang's behaviour on request: the API key opens the migration routes, and two such workers migrate."""
    a = start_server(api_key=API, allow_user_migration=True, kv_migration_watchdog_timeout=60)
    b = start_server(api_key=API, allow_user_migration=True, kv_migration_watchdog_timeout=60)
    for method, path in MIGRATION_ROUTES:
        assert _call(a, method, path, API).status_code not in (401, 403), path
    assert _call(a, "GET", "/metrics.json", API).json()["rids_hidden"] is False
    with WorkerClient(a.url, api_key=API) as src, WorkerClient(b.url, api_key=API) as dst:
        src.generate(GenerateReq(input_ids=IDS * 2, sampling_params=SamplingParamsMsg(max_new_tokens=1)))
        rec = move_kv(src, dst, IDS * 2)
    assert rec.ok and rec.bytes > 0, rec.error
    for s in (a, b):
        s.runtime.check_integrity()
        s.stop()


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (dict(host="0.0.0.0", enable_kv_migration=True), True),
        (dict(host="0.0.0.0", enable_kv_migration=True, api_key=API), True),
        (dict(host="0.0.0.0", enable_kv_migration=True, admin_api_key=ADMIN), False),
        (dict(host="0.0.0.0", enable_kv_migration=True, allow_user_migration=True), False),
        (dict(host="0.0.0.0", enable_kv_migration=False), False),
        (dict(host="127.0.0.1", enable_kv_migration=True), False),
        (dict(host="127.0.0.2", enable_kv_migration=True), False),
        (dict(host="localhost", enable_kv_migration=True), False),
    ],
)
def test_a_migration_worker_off_loopback_needs_an_admin_key(overrides: dict, refused: bool) -> None:
    from kvmove.errors import KvmoveError
    from kvmove.server.config import ServerConfig

    if refused:
        with pytest.raises(KvmoveError, match="needs --admin-api-key"):
            ServerConfig(**overrides)
    else:
        ServerConfig(**overrides)


def test_kvmove_serve_refuses_to_start_off_loopback_without_an_admin_key() -> None:
    """Exit 2 and one line, before the port is taken or the model built."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvmove.cli.main", "serve", "--host", "0.0.0.0", "--port", "0"]
    out = subprocess.run([*cmd, "--enable-kv-migration"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "needs --admin-api-key" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_migration_routes_not_served_without_enable_kv_migration(start_server) -> None:
    s = start_server(enable_kv_migration=False)
    for method, path in ADMIN_ROUTES[5:10]:
        assert _call(s, method, path).status_code == 404, path  # kvmove's own: not served at all
    for method, path in ADMIN_ROUTES[:5]:
        r = _call(s, method, path)  # the fork's: refused as the fork refuses them
        assert r.status_code in (403, 400) and r.json()["success"] is False, path
    assert _call(s, "GET", "/get_transfer_session_ids").status_code == 403
    s.stop()


def test_peers_present_the_admin_key_through_a_whole_migration(start_server, transport: str, monkeypatch) -> None:
    keys = dict(transport=transport, api_key=API, admin_api_key=ADMIN, kv_migration_watchdog_timeout=60)
    a, b = start_server(**keys), start_server(**keys)
    src, dst = WorkerClient(a.url, api_key=ADMIN), WorkerClient(b.url, api_key=ADMIN)
    rid = f"keyed-{transport}"
    body = GenerateReq(input_ids=IDS * 2, rid=rid, sampling_params=SamplingParamsMsg(max_new_tokens=40))
    out: dict[str, GenerateResp] = {}
    t = threading.Thread(target=lambda: out.setdefault("r", WorkerClient(a.url, api_key=API).generate(body)))
    t.start()
    pause_after_decoding(monkeypatch, a, rid, tokens=1)  # NOTE: held mid-decode, never finished before the hold
    rec = migrate_request(src, dst, rid)  # source -> target pull (and http reads), then the relayed hand-over
    t.join(timeout=60)
    assert rec.ok and rec.bytes > 0, rec.error
    assert out["r"].meta_info["migrated_to"] == b.url and len(out["r"].output_ids) == 40
    for s in (a, b):
        s.runtime.check_integrity()
        s.stop()
