"""The `kvmove migrate` demo's workload: skewed, prioritized rollouts on N loopback workers, with and without migration.

Worker 0 is the busy one: a shared prompt (a GRPO group's) is cached there, low-priority requests then take every
free page, and the group's high-priority samples arrive and queue behind that KV pressure while the other workers
are idle. With migration on, the controller moves each starving sample and its cached prefix to the worker with
the most room (policy ``starving-high-priority``); the target continues it and worker 0 relays the answer to the
request's client. The first move to a worker carries the prompt's pages, later ones to the same worker only what it
lacks (prefix dedup).
Every high-priority output is checked token for token against a solo greedy run on an in-process reference worker.

``routes="sglang"`` moves requests with the SGLang fork's routes only (``migrate_request_sglang``: abort on the
source, move the K/V, re-submit to the target); the workload still watches queues through ``/metrics``, and the
workers' integrity (a kvmove route) is not checked then.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvmove.errors import KvmoveError
from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import Migration, migrate_request, migrate_request_sglang
from kvmove.migration.errors import UnknownMigrationError
from kvmove.migration.policy import WorkerView, get_policy
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.server.messages import GenerateReq, GenerateResp, SamplingParamsMsg

HIGH, LOW = 10, 0
ADMIT_S = 20.0
"""How long the low-priority requests may take to be admitted on the busy worker."""


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int = 4
    prompt_len: int = 64
    suffix_len: int = 4
    high_new_tokens: int = 24
    low_requests: int = 4
    page_size: int = 16
    model: str = "qwen3-tiny"
    seed: int = 1
    policy: str = "starving-high-priority"
    deadline_s: float = 120.0
    routes: str = "kvmove"  # or "sglang": the fork's routes only


@dataclass
class RunResult:
    migrate: bool
    migrations: list[Migration] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    resume_seconds: dict[str, float] = field(default_factory=dict)
    reprefill_seconds: dict[str, float] = field(default_factory=dict)
    verified: dict[str, bool] = field(default_factory=dict)
    integrity: dict[str, str] = field(default_factory=dict)
    integrity_checked: bool = True
    finished_first: list[str] = field(default_factory=list)
    """High-priority requests picked for a move that finished on their source before it began: nothing moved, not a
    failed migration (their outputs are verified like every other)."""

    @property
    def integrity_ok(self) -> bool:
        return all(v == "" for v in self.integrity.values())

    def latency_quantile(self, q: float) -> float:
        values = sorted(self.latency.values())
        return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else 0.0

    def finished(self, rid: str) -> None:
        """Note ``rid`` (once) as finished on its source before its move began."""
        if rid not in self.finished_first:
            self.finished_first.append(rid)

    def p50(self) -> float:
        return statistics.median(self.latency.values()) if self.latency else 0.0


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParamsMsg:
    return SamplingParamsMsg(max_new_tokens=n, temperature=0.0)


def run_workload(
    clients: list[WorkerClient], cfg: WorkloadConfig, migrate: bool, pool: ThreadPoolExecutor
) -> RunResult:
    """One run: fill worker 0, queue the high-priority group there, migrate (or not), wait, verify, check."""
    if len(clients) < 2:
        raise KvmoveError("the migration workload needs at least 2 workers")
    for c in clients:
        c.flush_cache()
    busy, run = clients[0], RunResult(migrate)
    key = f"run-{'on' if migrate else 'off'}-{cfg.seed}"
    shared = _tokens(cfg.prompt_len, cfg.seed)
    busy.generate(GenerateReq(input_ids=shared, sampling_params=_greedy(1), extra_key=key, rid=f"{key}-warm"))
    lows = _fill(busy, cfg, key, pool)
    highs = {f"{key}-high{i}": shared + _tokens(cfg.suffix_len, 1000 + i) for i in range(cfg.requests)}
    submitted = {rid: time.perf_counter() for rid in highs}
    bodies = {rid: _body(rid, ids, cfg, key) for rid, ids in highs.items()}
    futures = {rid: pool.submit(busy.generate, body, cfg.deadline_s) for rid, body in bodies.items()}
    if migrate:
        futures.update(_migrate_starving(clients, cfg, bodies, futures, pool, run))
    for rid, fut in futures.items():
        resp = fut.result(timeout=cfg.deadline_s)
        run.latency[rid] = time.perf_counter() - submitted[rid]
        run.outputs[rid] = resp.output_ids
        if rid in {mg.rid for mg in run.migrations if mg.ok}:
            run.resume_seconds[rid] = resp.meta_info.get("first_token_seconds") or 0.0
    for f in lows:
        f.result(timeout=cfg.deadline_s)
    _verify(run, highs, cfg)
    _reprefill(run, clients, key)
    run.integrity_checked = cfg.routes == "kvmove"
    run.integrity = {c.url: c.integrity().message for c in clients} if run.integrity_checked else {}
    return run


def _body(rid: str, ids: list[int], cfg: WorkloadConfig, key: str) -> GenerateReq:
    return GenerateReq(
        input_ids=ids, rid=rid, sampling_params=_greedy(cfg.high_new_tokens), priority=HIGH, extra_key=key
    )


def _fill(busy: WorkerClient, cfg: WorkloadConfig, key: str, pool: ThreadPoolExecutor) -> list[Future[GenerateResp]]:
    """Low-priority requests that reserve exactly the free pages of ``busy`` (no cache evicted)."""
    free, ps = busy.metrics().free_pages, cfg.page_size
    share = -(-free // cfg.low_requests)
    sizes = [min(share, free - i * share) for i in range(cfg.low_requests) if free - i * share > 0]
    futures = []
    for i, pages in enumerate(sizes):
        ids = _tokens(4, 2000 + i)
        body = GenerateReq(
            input_ids=ids, rid=f"{key}-low{i}", sampling_params=_greedy(pages * ps - 3), priority=LOW, extra_key=key
        )
        futures.append(pool.submit(busy.generate, body, cfg.deadline_s))
    deadline = time.monotonic() + ADMIT_S
    while time.monotonic() < deadline:
        # a request that reserved few pages may finish before the last one arrives: it was admitted all the same
        finished = sum(f.done() for f in futures)
        mt = busy.metrics()
        if mt.running + finished >= len(sizes) and not mt.waiting_per_priority:
            return futures
        time.sleep(0.01)
    raise KvmoveError(f"low-priority requests were not all admitted within {ADMIT_S:g} s")


def _migrate_starving(
    clients: list[WorkerClient],
    cfg: WorkloadConfig,
    bodies: dict[str, GenerateReq],
    futures: dict[str, Future[GenerateResp]],
    pool: ThreadPoolExecutor,
    run: RunResult,
) -> dict[str, Future[GenerateResp]]:
    """Poll /metrics and migrate every starving high-priority request the policy picks, until none is left."""
    highs = set(bodies)
    by_url, policy = {c.url: c for c in clients}, get_policy(cfg.policy)
    need = -(-(cfg.prompt_len + cfg.suffix_len + cfg.high_new_tokens) // cfg.page_size)
    resumed: dict[str, Future[GenerateResp]] = {}
    deadline = time.monotonic() + cfg.deadline_s
    while time.monotonic() < deadline:
        views = [WorkerView(c.url, c.metrics()) for c in clients]
        waiting = {r for v in views for rids in v.metrics.waiting_rids.values() for r in rids} & highs
        if not waiting - set(resumed):
            break
        for d in policy(views, HIGH, need):
            if d.rid not in highs or d.rid in resumed:
                continue
            src, dst = by_url[d.source], by_url[d.target]
            if cfg.routes == "sglang":
                moved = _move_over_fork_routes(src, dst, bodies[d.rid], futures[d.rid], cfg, pool, run)
                if moved is not None:
                    resumed[d.rid] = moved
                continue
            try:
                rec = migrate_request(src, dst, d.rid)
            except UnknownMigrationError:  # NOTE: it got admitted and finished since the metrics were read
                run.finished(d.rid)
                continue
            run.migrations.append(rec)
            if rec.ok:  # NOTE: the source relays the target's answer: the original future answers for it
                resumed[d.rid] = futures[d.rid]
        time.sleep(0.005)
    return resumed


def _move_over_fork_routes(
    src: WorkerClient,
    dst: WorkerClient,
    body: GenerateReq,
    answer: Future[GenerateResp],
    cfg: WorkloadConfig,
    pool: ThreadPoolExecutor,
    run: RunResult,
) -> Future[GenerateResp] | None:
    """Abort, move, re-submit (``migrate_request_sglang``); the future answers the whole output."""
    try:
        rec, resume = migrate_request_sglang(src, dst, body, lambda: answer.result(timeout=cfg.deadline_s))
    except UnknownMigrationError:  # NOTE: it finished since the metrics were read
        run.finished(body.rid or "")
        return None
    if resume is None:  # NOTE: it finished before the abort reached it: its answer is whole, nothing moved
        run.finished(rec.rid)
        return None
    run.migrations.append(rec)
    partial = answer.result().output_ids
    return pool.submit(_continued, dst, resume, partial, cfg.deadline_s)


def _continued(dst: WorkerClient, body: GenerateReq, partial: list[int], timeout: float) -> GenerateResp:
    resp = dst.generate(body, timeout)
    return resp.model_copy(update={"output_ids": partial + resp.output_ids})


def _verify(run: RunResult, highs: dict[str, list[int]], cfg: WorkloadConfig) -> None:
    """Each high-priority output against a solo greedy run of the same prompt (no migration, no batching)."""
    model = resolve_model(cfg.model)
    ref = RolloutWorker(model, seeded_checkpoint(model, cfg.seed).items(), WorkerConfig(num_pages=64, page_size=16))
    for rid, ids in highs.items():
        ref.submit(Request(rid, ids, SamplingParams(max_new_tokens=cfg.high_new_tokens)))
        (done,) = ref.run_until_idle()
        run.verified[rid] = done.output_ids == run.outputs.get(rid)


def _reprefill(run: RunResult, clients: list[WorkerClient], key: str) -> None:
    """Time to first token of each migrated request's tokens on its target without the migrated K/V."""
    by_url = {c.url: c for c in clients}
    for rec in run.migrations:
        if not rec.ok or not rec.tokens:
            continue
        body = GenerateReq(
            input_ids=rec.tokens,
            sampling_params=_greedy(1),
            extra_key=f"{key}-reprefill",
            rid=f"{rec.rid}-reprefill",
        )
        run.reprefill_seconds[rec.rid] = by_url[rec.target].generate(body).meta_info.get("first_token_seconds") or 0.0
