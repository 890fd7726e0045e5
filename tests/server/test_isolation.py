"""One request cannot hurt another: malformed values are refused at the edge with a 400 naming the field, and a
request that raises while being stepped fails alone, while requests batched beside it finish exactly as they would
have alone (greedy outputs checked against solo runs)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx
import torch
from server_fixtures import hold_admissions

from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import FinishReason, Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.reference import runner as runner_module
from kvmove.reference.scheduler import ScheduledBatch

BIG = 1 << 63
MALFORMED = [
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 1 << 64}}, "sampling_seed"),
    ("/generate", b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "temperature"),
    ("/generate", b'{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}', "temperature"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"input_ids": [1, BIG]}, "input_ids"),
    ("/generate", {"input_ids": [1, 2], "priority": 1 << 64}, "priority"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [BIG]}}, "stop_token_ids"),
    ("/generate", b'{"text": "bad \\ud800 text"}', "text"),
    ("/generate", b'{"input_ids": [1, 2], "extra_key": "\\udfff"}', "extra_key"),
    ("/generate", b'{"input_ids": [1, 2], "rid": "r\\ud800"}', "rid"),
    ("/tokenize", b'{"prompt": ["ok", "\\ud83d"]}', "prompt"),
    ("/detokenize", {"tokens": [BIG]}, "tokens"),
    ("/allocate_token_for_transfer_request", {"input_ids": [BIG], "extra_token_size": 4}, "input_ids"),
    ("/get_request_extra_token_size", {"input_ids": [1], "extra_key": None, "rid": None, "x": [BIG]}, None),
    ("/kvmove/pull_kv", {"input_ids": [1], "matched_token_size": 0, "kv_indices": [BIG], "src_pages": [1 << 64]}, ""),
]


def _solo(ids: list[int], n: int) -> list[int]:
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=4))
    w.submit(Request("ref", ids, SamplingParams(max_new_tokens=n)))
    return w.run_until_idle()[0].output_ids


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _post(url: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, timeout=60)


class _Bystanders:
    """Greedy requests running on ``server`` while the test does something nasty beside them."""

    def __init__(self, server, n: int = 3, new_tokens: int = 24, wait_running: bool = True) -> None:
        self.server, self.new_tokens, self.wait_running = server, new_tokens, wait_running
        self.prompts = {f"bystander-{i}-{time.monotonic_ns()}": _ids(10, 100 + i) for i in range(n)}
        self.answers: dict[str, httpx.Response] = {}
        self._threads = [threading.Thread(target=self._run, args=(rid,)) for rid in self.prompts]

    def _run(self, rid: str) -> None:
        params = {"max_new_tokens": self.new_tokens, "temperature": 0}
        body = {"input_ids": self.prompts[rid], "rid": rid, "sampling_params": params}
        self.answers[rid] = _post(f"{self.server.url}/generate", body)

    def __enter__(self) -> _Bystanders:
        for t in self._threads:
            t.start()
        deadline = time.monotonic() + 30
        while self.wait_running and not set(self.prompts) & set(self.server.runtime.worker.scheduler.running):
            assert time.monotonic() < deadline, "bystanders never ran"
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self._threads:
            t.join(timeout=120)

    def check(self) -> None:
        for rid, ids in self.prompts.items():
            r = self.answers[rid]
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == _solo(ids, self.new_tokens), f"{rid} changed by its neighbours"


def test_malformed_values_are_400_and_bystanders_finish_untouched(pair) -> None:
    a, _ = pair
    with _Bystanders(a) as bystanders:
        for route, body, field in MALFORMED:
            r = _post(f"{a.url}{route}", body)
            if field is None:  # unknown keys are ignored, whatever they hold
                assert r.status_code == 200, r.text
                continue
            assert r.status_code == 400, (route, body, r.text)
            assert r.json()["success"] is False and field in r.json()["message"], r.text
    bystanders.check()
    a.runtime.check_integrity()


def test_a_tiny_temperature_samples_greedily(pair) -> None:
    a, _ = pair
    ids = _ids(10, 7)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 3e-38, "sampling_seed": 5}}
    r = _post(f"{a.url}/generate", body)
    assert r.status_code == 200 and r.json()["output_ids"] == _solo(ids, 8)


def test_a_request_that_raises_while_stepped_fails_alone(pair, monkeypatch) -> None:
    """The poisoned request starts in the bystanders' batch: admissions are held until all four are queued."""
    a, _ = pair
    real = runner_module.sample
    scheduler = a.runtime.worker.scheduler
    batches: list[set[str]] = []
    schedule = scheduler.schedule

    def recorded() -> ScheduledBatch:
        batch = schedule()
        batches.append({r.rid for r in batch.requests})
        return batch

    def sample(req: Request, logits: torch.Tensor) -> int:
        if req.rid == "poisoned":
            raise RuntimeError("injected sampling failure")
        return real(req, logits)

    monkeypatch.setattr(runner_module, "sample", sample)
    monkeypatch.setattr(scheduler, "schedule", recorded)
    start_together = hold_admissions(monkeypatch, a)
    answer: dict[str, httpx.Response] = {}
    body = {"input_ids": _ids(6, 9), "rid": "poisoned", "sampling_params": {"max_new_tokens": 8}}  # fits beside them
    culprit = threading.Thread(target=lambda: answer.setdefault("r", _post(f"{a.url}/generate", body)))
    with _Bystanders(a, wait_running=False) as bystanders:
        culprit.start()
        deadline = time.monotonic() + 30
        while scheduler.num_waiting < 4:
            assert time.monotonic() < deadline, "the requests were never queued"
            time.sleep(0.002)
        start_together()
        culprit.join(timeout=120)
    assert {"poisoned", *bystanders.prompts} in batches, "the poisoned request ran beside the bystanders"
    r = answer["r"]
    assert r.status_code == 500 and "poisoned" in r.json()["message"] and "injected" in r.json()["message"]
    bystanders.check()
    a.runtime.check_integrity()


POISON = 255


def test_a_forward_pass_that_raises_is_retried_per_request(monkeypatch) -> None:
    """The shared forward raises because of one request: the batch is rerun one request at a time, the culprit fails
    (``FinishReason.ERROR``, its pages released), every other request continues exactly."""
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=4))
    real = runner_module.forward_ranks

    def forward_ranks(models, pools, batch):
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("injected forward failure")
        return real(models, pools, batch)

    monkeypatch.setattr(runner_module, "forward_ranks", forward_ranks)
    prompts = {f"r{i}": _ids(9, 200 + i) for i in range(3)}
    for rid, ids in prompts.items():
        w.submit(Request(rid, [t % POISON for t in ids], SamplingParams(max_new_tokens=12)))
    w.submit(Request("culprit", [1, 2, POISON], SamplingParams(max_new_tokens=12)))
    done = {r.rid: r for r in w.run_until_idle()}
    assert done["culprit"].finish_reason is FinishReason.ERROR and "injected" in done["culprit"].error
    monkeypatch.setattr(runner_module, "forward_ranks", real)
    for rid, ids in prompts.items():
        assert done[rid].output_ids == _solo([t % POISON for t in ids], 12)
    w.check_integrity()
    assert w.pool.used_pages == w.kv.tree.total_pages, "the culprit's pages went back (cached or freed)"


def test_sampling_that_cannot_work_fails_its_request_not_the_batch() -> None:
    """Below the edge (a library caller): a temperature so small that softmax overflows fails that request only."""
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=4))
    w.submit(Request("ok", _ids(8, 1), SamplingParams(max_new_tokens=5)))
    w.submit(Request("tiny", _ids(8, 2), SamplingParams(max_new_tokens=5, temperature=1e-40)))
    done = {r.rid: r for r in w.run_until_idle()}
    assert done["tiny"].finish_reason is FinishReason.ERROR and "non-finite" in done["tiny"].error
    assert done["ok"].output_ids == _solo(_ids(8, 1), 5)
    w.check_integrity()
