"""The HTTP contract: the SGLang fork's example bodies and field names, SGLang-style generate/tokenize, errors."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx

IDS = list(range(1, 17))  # 16 tokens: 4 pages of 4


def test_fork_example_bodies_and_field_names(pair) -> None:
    a, b = pair
    s = httpx.get(f"{b.url}/get_transfer_session_ids").json()
    assert set(s) == {"topology", "ranks"} and set(s["topology"]) == {"tp_size", "pp_size", "page_size"}
    assert {"tp", "pp", "session_id", "host_kv_data_ptrs", "host_kv_item_lens"} <= set(s["ranks"][0])
    gen = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "extra_key": "fork"}
    assert httpx.post(f"{a.url}/generate", json=gen, timeout=30).status_code == 200
    base = {"input_ids": IDS, "extra_key": "fork", "rid": None, "http_worker_ipc": None}  # BaseReq extras accepted
    x = httpx.post(f"{b.url}/get_request_extra_token_size", json=base).json()
    assert x == {"success": True, "extra_token_size": 16, "matched_token_size": 0, "total_token_size": 16}
    al = httpx.post(
        f"{b.url}/allocate_token_for_transfer_request", json={**base, "extra_token_size": 16, "migration_id": None}
    ).json()
    assert set(al) == {"success", "migration_id", "per_rank_kv_indices"} and len(al["migration_id"]) == 32
    (rank,) = al["per_rank_kv_indices"]
    assert set(rank) == {"tp", "pp", "kv_indices"} and len(rank["kv_indices"]) == 16
    target = {k: s["ranks"][0][k] for k in ("tp", "pp", "session_id", "host_kv_data_ptrs", "host_kv_item_lens")}
    t = httpx.post(
        f"{a.url}/transfer_request_kvcache",
        timeout=30,
        json={
            "input_ids": IDS,
            "extra_key": "fork",
            "matched_token_size": 0,
            "extra_token_size": 16,
            "target_per_rank": [{**target, "kv_indices": rank["kv_indices"]}],
        },
    )
    assert t.status_code == 200 and t.json()["success"] is True
    c = httpx.post(f"{b.url}/commit_transfer_request_kvcache", json={"migration_id": al["migration_id"]}).json()
    assert c["success"] is True and c["matched_after_commit"] == 16
    again = httpx.post(f"{b.url}/commit_transfer_request_kvcache", json={"migration_id": al["migration_id"]})
    assert again.status_code == 404 and again.json()["success"] is False and "not found" in again.json()["message"]
    for s_ in pair:
        s_.runtime.check_integrity()


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/get_request_extra_token_size", {"extra_key": None}),
        ("/get_request_extra_token_size", {"input_ids": "abc"}),
        ("/allocate_token_for_transfer_request", {"input_ids": [1, 2], "extra_token_size": "x"}),
        ("/transfer_request_kvcache", {"input_ids": [1], "target_per_rank": [{"tp": 0}]}),
        ("/commit_transfer_request_kvcache", []),
        ("/generate", {"input_ids": [1, 2], "text": "both"}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}),
        ("/generate", {"input_ids": [1, 999]}),
        ("/allocate_token_for_transfer_request", {"input_ids": IDS, "extra_token_size": 3}),
    ],
)
def test_malformed_payloads_are_400(pair, route: str, body: object) -> None:
    r = httpx.post(f"{pair[1].url}{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and r.json()["message"]
    pair[1].runtime.check_integrity()


def test_invalid_json_oversized_and_unknown_ids(pair) -> None:
    url = pair[1].url
    bad = httpx.post(
        f"{url}/commit_transfer_request_kvcache", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["success"] is False
    big = httpx.post(f"{url}/generate", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert big.status_code == 413
    for route in ("/commit_transfer_request_kvcache", "/abort_transfer_request_kvcache"):
        r = httpx.post(f"{url}{route}", json={"migration_id": "0" * 32})
        assert r.status_code == 404 and r.json() == {"success": False, "message": r.json()["message"]}
    assert httpx.post(f"{url}/kvmove/hold_request", json={"rid": "nobody"}).status_code == 404


def test_migration_routes_refused_when_disabled(start_server) -> None:
    s = start_server(enable_kv_migration=False)
    r = httpx.get(f"{s.url}/get_transfer_session_ids")
    assert r.status_code == 403 and "not enabled" in r.json()["message"]
    r = httpx.post(f"{s.url}/allocate_token_for_transfer_request", json={"input_ids": IDS})
    assert r.status_code == 403
    s.stop()


def test_generate_tokenize_health_metrics(pair) -> None:
    url = pair[0].url
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    tok = httpx.post(f"{url}/tokenize", json={"model": "default", "prompt": "hi!"}).json()
    assert tok["tokens"] == [104, 105, 33] and tok["count"] == 3
    out = httpx.post(
        f"{url}/generate",
        timeout=30,
        json={
            "text": "hello kvmove",
            "rid": "g1",
            "priority": 3,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        },
    ).json()
    assert len(out["output_ids"]) == 5 and out["meta_info"]["id"] == "g1"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["prompt_tokens"] == 12
    met = httpx.get(f"{url}/metrics.json").json()
    assert {"waiting_per_priority", "running", "free_pages", "used_pages", "migrations_pending"} <= set(met)
    assert met["free_pages"] + met["used_pages"] == met["total_pages"]


def test_resources_count_the_processes_os_threads(start_server) -> None:
    """``threads`` is what ``/proc/self/task`` lists (torch's and NIXL's threads too), not Python's count."""
    import os
    import threading

    import httpx

    s = start_server()
    got = httpx.get(f"{s.url}/kvmove/resources", timeout=30).json()["threads"]
    tasks = len(os.listdir("/proc/self/task"))  # NOTE: the server runs in this process
    assert abs(got - tasks) <= 2 and got > threading.active_count()
    s.stop()
