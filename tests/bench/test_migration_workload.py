"""The migrate demo's workload harness: filling the busy worker with low-priority requests."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from kvmove.bench import migration_workload
from kvmove.bench.migration_workload import WorkloadConfig, _fill
from kvmove.errors import KvmoveError


class _Busy:
    """A worker whose first low-priority request (the one reserving fewest pages) finishes at once, while the
    others keep running until ``release``."""

    def __init__(self, free_pages: int, waiting: bool = False) -> None:
        self.free_pages, self.waiting = free_pages, waiting
        self.release, self.lock = threading.Event(), threading.Lock()
        self.running = 0

    def metrics(self) -> SimpleNamespace:
        with self.lock:
            waiting = {0: ["low-late"]} if self.waiting else {}
            return SimpleNamespace(free_pages=self.free_pages, running=self.running, waiting_per_priority=waiting)

    def generate(self, body, timeout):
        if body.sampling_params.max_new_tokens <= 1:  # a one-page request: done before the others are admitted
            return SimpleNamespace(output_ids=[1])
        with self.lock:
            self.running += 1
        self.release.wait(timeout)
        with self.lock:
            self.running -= 1
        return SimpleNamespace(output_ids=[1])


def test_a_low_request_that_already_finished_counts_as_admitted(monkeypatch) -> None:
    monkeypatch.setattr(migration_workload, "ADMIT_S", 2.0)
    busy = _Busy(free_pages=13)  # 4 requests of 4, 4, 4 and 1 pages: the 1-page one decodes a single token
    cfg = WorkloadConfig(low_requests=4, page_size=4)
    with ThreadPoolExecutor(4) as pool:
        try:
            futures = _fill(busy, cfg, "k", pool)  # type: ignore[arg-type]
            assert len(futures) == 4 and sum(f.done() for f in futures) == 1
        finally:
            busy.release.set()


def test_a_low_request_still_waiting_is_not_admitted(monkeypatch) -> None:
    monkeypatch.setattr(migration_workload, "ADMIT_S", 0.3)
    busy = _Busy(free_pages=16, waiting=True)
    with ThreadPoolExecutor(4) as pool:
        try:
            with pytest.raises(KvmoveError, match=r"not all admitted within 0\.3 s"):
                _fill(busy, WorkloadConfig(low_requests=4, page_size=4), "k", pool)  # type: ignore[arg-type]
        finally:
            busy.release.set()


class _Finished:
    """A source whose request had finished when the abort reached it (its answer ended on its length)."""

    url = "http://source"

    def abort_request(self, rid: str) -> None:
        self.aborted = rid


def test_a_request_that_finished_before_its_move_is_not_a_failed_migration() -> None:
    """Over the fork's routes, a request picked for a move may finish on its source before the abort reaches it:
    nothing moved, its answer is whole (and verified like any other), so the run records it as finished first,
    not as a failed migration, and the summary's ``failed`` stays 0."""
    from kvmove.bench.migration_report import summarize
    from kvmove.migration.endpoint import TransportChoice

    body = migration_workload._body("r1", [1, 2, 3], WorkloadConfig(), "k")
    answer: Future[SimpleNamespace] = Future()
    answer.set_result(SimpleNamespace(output_ids=[7] * 8, meta_info={"finish_reason": {"type": "length"}}))
    run = migration_workload.RunResult(migrate=True)
    with ThreadPoolExecutor(1) as pool:
        moved = migration_workload._move_over_fork_routes(
            _Finished(),  # type: ignore[arg-type]
            SimpleNamespace(url="http://target"),  # type: ignore[arg-type]
            body,
            answer,
            WorkloadConfig(),
            pool,
            run,
        )
    assert moved is None and run.migrations == [] and run.finished_first == ["r1"]
    run.finished("r1")
    assert run.finished_first == ["r1"]  # noted once
    run.verified["r1"] = True
    (summary,) = summarize([run], None, TransportChoice("nixl", "nixl"))
    assert (summary["migrations"], summary["failed"], summary["finished_before_move"]) == (0, 0, 1)
    assert summary["verified"]
