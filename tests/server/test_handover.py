"""Hand-over with nothing lost: the source keeps a migrated request until its target answered, and if the target
dies first (before resuming it, or while continuing it) or the controller never releases it, the request resumes
on the source, token for token as it would have run without migration (greedy and seeded sampling)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import torch
from server_fixtures import pause_after_decoding

from kvmove.migration import messages as m
from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import transfer_body
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.server.messages import GenerateReq, GenerateResp, HoldRequestResp, SamplingParamsMsg

SAMPLINGS = {"greedy": (0.0, 0), "seeded": (0.8, 1234)}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _unmigrated(ids: list[int], n: int, temperature: float, seed: int) -> list[int]:
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=4))
    w.submit(Request("ref", ids, SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed)))
    return w.run_until_idle()[0].output_ids


class _Client:
    """A client of the source, waiting for its request's answer in a thread."""

    def __init__(self, monkeypatch, server, rid: str, ids: list[int], n: int, temperature: float, seed: int) -> None:
        params = SamplingParamsMsg(max_new_tokens=n, temperature=temperature, sampling_seed=seed)
        self.body = GenerateReq(input_ids=ids, rid=rid, sampling_params=params, extra_key=rid)
        self.server, self.rid, self.answer = server, rid, None
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        pause_after_decoding(monkeypatch, server, rid, tokens=3)  # NOTE: held mid-decode, never finished first

    def _run(self) -> None:
        self.answer = WorkerClient(self.server.url, timeout=300).generate(self.body)

    def result(self) -> GenerateResp:
        self._thread.join(timeout=300)
        assert self.answer is not None
        return self.answer


def _move(src: WorkerClient, dst: WorkerClient, held: HoldRequestResp) -> None:
    """Allocate -> transfer -> commit of the held request's K/V (the controller's protocol, step by step)."""
    ids, key = held.input_ids, held.request.extra_key
    size = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    alloc = dst.allocate(
        m.AllocateTokenForTransferReq(input_ids=ids, extra_key=key, extra_token_size=size.extra_token_size)
    )
    src.transfer(transfer_body(ids, key, size, dst.session_ids(), alloc))
    dst.commit(alloc.migration_id)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_target_dead_after_commit_the_request_resumes_on_the_source(
    pair, start_server, sampling: str, monkeypatch
) -> None:
    a, _ = pair
    doomed = start_server(transport=a.config.transport)
    temperature, seed = SAMPLINGS[sampling]
    ids, rid = _ids(14, 41), f"orphan-{sampling}-{a.config.transport}"
    client = _Client(monkeypatch, a, rid, ids, 40, temperature, seed)
    src, dst = WorkerClient(a.url), WorkerClient(doomed.url)
    held = src.hold(rid)
    _move(src, dst, held)
    doomed.stop()  # the target dies after commit, before it resumed the request
    assert src.release(rid, migrated=True, target=doomed.url).state == "migrated"
    done = client.result()
    assert done.output_ids == _unmigrated(ids, 40, temperature, seed), "resumed token-identically"
    assert "migrated_to" not in done.meta_info and done.meta_info["finish_reason"]["type"] == "length"
    assert len(held.request.output_ids) >= 3, "it had decoded before the move"
    a.runtime.check_integrity()
    assert not a.runtime.held.held and a.runtime.endpoint.outbox.used_pages == 0


def test_a_request_never_released_resumes_after_the_hold_timeout(start_server, monkeypatch) -> None:
    a = start_server(hold_timeout=1.0)
    ids, rid = _ids(12, 42), "abandoned"
    client = _Client(monkeypatch, a, rid, ids, 30, 0.0, 0)
    WorkerClient(a.url).hold(rid)  # ... and the controller dies
    done = client.result()
    assert done.output_ids == _unmigrated(ids, 30, 0.0, 0)
    a.runtime.check_integrity()
    assert not a.runtime.held.held and a.runtime.worker.kv.export_locks == 0
    a.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_target_killed_while_continuing_the_request_resumes_on_the_source(
    pair, tmp_path, sampling: str, monkeypatch
) -> None:
    """The target is a real process, SIGKILLed once it is generating the migrated request."""
    from kvmove.ports import free_port
    from kvmove.server.launch import LocalCluster

    a, _ = pair
    config = a.config.__class__(
        port=free_port(), enable_kv_migration=True, transport=a.config.transport, page_size=4, num_pages=48
    )
    temperature, seed = SAMPLINGS[sampling]
    ids, rid = _ids(14, 43), f"killed-{sampling}-{a.config.transport}"
    with LocalCluster([config], tmp_path) as cluster:
        client = _Client(monkeypatch, a, rid, ids, 160, temperature, seed)
        src, dst = WorkerClient(a.url), WorkerClient(cluster.urls[0])
        held = src.hold(rid)
        _move(src, dst, held)
        src.release(rid, migrated=True, target=dst.url)
        deadline = time.monotonic() + 60
        while rid not in dst.metrics().running_rids:
            assert time.monotonic() < deadline, "the target never continued the request"
            time.sleep(0.01)
        os.kill(cluster.procs[0].pid, signal.SIGKILL)
        done = client.result()
    assert done.output_ids == _unmigrated(ids, 160, temperature, seed)
    assert "migrated_to" not in done.meta_info
    a.runtime.check_integrity()
