"""The soak: many migrations between two ``kvmove serve`` processes per KV transport, with what each server holds
read after a warm-up and again at the end, so any growth shows as a delta.

Every migration moves a freshly cached prompt's K/V from one server to the other (allocate -> transfer -> commit
over the transport); every ``handover_every``-th one is instead a whole hand-over of a live request (queued on the
source, held, its K/V moved, released; the source relays the target's answer, checked token for token against an
unmigrated run). Directions alternate, so each server is source and target in turn. Every ``abandon_every``-th
step a client also gives up on a long request (disconnects after 0.2 s: the server must abort it), and every
``stall_every``-th one a client sends half a body and stalls (the server must close it after its body timeout,
``kvmove.bench.misbehaving``). Before each reading both caches are flushed, so device pages must be back to zero
too, and the stalled connections must have been closed.

What is read (``/kvmove/resources`` of each server): open file descriptors, resident bytes and OS threads
(``/proc/self/task``) of the process; device, inbox and outbox pages in use; locked pages and export locks; pending
migrations, held and in-flight requests, open read grants.
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvmove.bench.misbehaving import MisbehavingClients
from kvmove.bench.results import Row
from kvmove.errors import KvmoveError
from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import Migration, migrate_request, move_kv
from kvmove.migration.endpoint import SERVER_TRANSPORTS
from kvmove.migration.errors import UnknownMigrationError
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.server.messages import GenerateReq, GenerateResp, Resources, SamplingParamsMsg
from kvmove.transport import TRANSPORTS

HELD = (
    "device_used_pages",
    "device_locked_pages",
    "export_locks",
    "host_used_pages",
    "outbox_used_pages",
    "migrations_pending",
    "held_requests",
    "inflight_requests",
    "open_grants",
)
"""What an idle, flushed server must hold none of."""


@dataclass(frozen=True)
class SoakConfig:
    migrations: int = 200
    warmup: int = 20
    transports: tuple[str, ...] = ()  # empty: every server transport installed here
    prompt_len: int = 48
    new_tokens: int = 32
    """Tokens each live request generates: enough decode steps that the client can hold it while it runs on a
    loaded 2-core host (at 8, a request finished before its hold 5 times in a row in one CI run)."""
    page_size: int = 16
    num_pages: int = 64
    model: str = "qwen3-tiny"
    seed: int = 1
    handover_every: int = 10
    fd_slack: int = 2
    rss_slack_bytes: int = 64 << 20
    thread_slack: int = 2
    abandon_every: int = 10  # a client giving up on a long request every N steps (0: never)
    stall_every: int = 10  # a client stalling halfway through its body every N steps (0: never)
    abandoned_tokens: int = 400
    body_timeout: float = 1.0  # the servers' --body-timeout


@dataclass
class SoakResult:
    """One transport's soak: ``before``/``after`` are each server's resources (by URL), after the warm-up and at
    the end; ``migrations`` the protocol records."""

    transport: str
    before: dict[str, Resources]
    after: dict[str, Resources]
    migrations: list[Migration] = field(default_factory=list)
    verified: int = 0
    wrong: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    rude: MisbehavingClients = field(default_factory=MisbehavingClients)

    def growth(self) -> dict[str, int]:
        """Largest after - before over the servers, per resource."""
        keys = Resources.model_fields
        return {k: max(getattr(self.after[u], k) - getattr(self.before[u], k) for u in self.before) for k in keys}

    def problems(self, cfg: SoakConfig) -> list[str]:
        """Why this soak is not flat (empty if it is): a failed or wrong migration, or a resource that grew."""
        grew = self.growth()
        out = [f"{mg.rid}: {mg.error}" for mg in self.migrations if not mg.ok] + self.wrong
        out += [f"{k} grew by {grew[k]}" for k in HELD if grew[k] or any(getattr(r, k) for r in self.after.values())]
        for key, slack in (("fds", cfg.fd_slack), ("rss_bytes", cfg.rss_slack_bytes), ("threads", cfg.thread_slack)):
            if grew[key] > slack:
                out.append(f"{key} grew by {grew[key]} (> {slack})")
        return out


def soak_transports(cfg: SoakConfig) -> list[str]:
    """The transports a soak runs: those asked for, or every server transport installed here."""
    names = cfg.transports or tuple(n for n in SERVER_TRANSPORTS if TRANSPORTS[n].is_available())
    unknown = [n for n in names if n not in SERVER_TRANSPORTS]
    if unknown or not names:
        raise KvmoveError(f"the soak runs over {', '.join(SERVER_TRANSPORTS)} (installed ones), not {unknown}")
    return list(names)


def run_soak(cfg: SoakConfig, transport: str, log_dir: Path | None = None) -> SoakResult:
    """Two servers over ``transport`` (loopback subprocesses, an admin key of this run), the warm-up, the soak."""
    from kvmove.ports import free_port
    from kvmove.server.config import ServerConfig
    from kvmove.server.launch import LocalCluster

    key = secrets.token_urlsafe(24)
    base = ServerConfig(
        model=cfg.model,
        seed=cfg.seed,
        num_pages=cfg.num_pages,
        page_size=cfg.page_size,
        transport=transport,
        enable_kv_migration=True,
        admin_api_key=key,
        body_timeout=cfg.body_timeout,
    )
    configs = [replace(base, port=free_port()) for _ in range(2)]
    with tempfile.TemporaryDirectory(prefix="kvmove-soak-") as tmp, LocalCluster(configs, log_dir or Path(tmp)) as c:
        clients = [WorkerClient(u, timeout=120, api_key=key) for u in c.urls]
        try:
            return _soak(cfg, transport, clients, key)
        finally:
            for client in clients:
                client.close()


def _soak(cfg: SoakConfig, transport: str, clients: list[WorkerClient], key: str) -> SoakResult:
    reference = _Reference(cfg)
    rude = MisbehavingClients(body_timeout=cfg.body_timeout)
    with ThreadPoolExecutor(max_workers=2) as pool:
        warm = SoakResult(transport, {}, {}, rude=rude)
        for i in range(cfg.warmup):
            _step(i, clients, pool, cfg, reference, warm, key)
        warm.wrong += rude.settle(clients)
        result = SoakResult(transport, _resources(clients), {}, wrong=warm.wrong, rude=rude)
        start = time.perf_counter()
        for i in range(cfg.warmup, cfg.warmup + cfg.migrations):
            result.migrations.append(_step(i, clients, pool, cfg, reference, result, key))
        result.wall_seconds = time.perf_counter() - start
    result.wrong += rude.settle(clients)
    result.after = _resources(clients)
    return result


def _step(
    i: int,
    clients: list[WorkerClient],
    pool: ThreadPoolExecutor,
    cfg: SoakConfig,
    ref: _Reference,
    result: SoakResult,
    key: str,
) -> Migration:
    """Migration ``i``, and the misbehaving clients whose turn it is."""
    if cfg.abandon_every and i % cfg.abandon_every == 0:
        ids = _tokens(cfg.prompt_len, 10_000 + i)
        result.rude.abandon(clients[(i + 1) % 2].url, ids, cfg.abandoned_tokens, key)
    if cfg.stall_every and i % cfg.stall_every == 0:
        result.rude.stall(clients[i % 2].url)
    return _migration(i, clients, pool, cfg, ref, result)


def _migration(
    i: int, clients: list[WorkerClient], pool: ThreadPoolExecutor, cfg: SoakConfig, ref: _Reference, result: SoakResult
) -> Migration:
    src, dst = clients[i % 2], clients[1 - i % 2]
    ids = _tokens(cfg.prompt_len, cfg.seed + i)
    if i % cfg.handover_every:
        _cache(src, ids, f"soak-{i}")
        return move_kv(src, dst, ids, f"soak-{i}")
    return _hand_over(i, src, dst, ids, pool, ref, result)


def _cache(c: WorkerClient, ids: list[int], key: str) -> None:
    c.generate(
        GenerateReq(input_ids=ids, sampling_params=SamplingParamsMsg(max_new_tokens=1, temperature=0), extra_key=key)
    )


def _hand_over(
    i: int,
    src: WorkerClient,
    dst: WorkerClient,
    ids: list[int],
    pool: ThreadPoolExecutor,
    reference: _Reference,
    result: SoakResult,
) -> Migration:
    """One migrated live request (retried under a new rid, at most 5 times, if it finished before it was held)."""
    for attempt in range(5):
        rid = f"soak-{i}-{attempt}"
        _cache(src, ids, rid)
        body = GenerateReq(input_ids=ids, rid=rid, sampling_params=reference.params, extra_key=rid)
        answer = pool.submit(src.generate, body, 120)
        rec = _migrate_when_queued(src, dst, rid, answer)
        out = answer.result(timeout=120)
        if rec is not None:
            break
    else:
        raise KvmoveError(f"soak migration {i}: the request finished before it could be held, 5 times")
    result.verified += 1
    if out.meta_info.get("migrated_to") != dst.url or out.output_ids != reference.output(ids):
        result.wrong.append(f"{rid}: not continued on {dst.url} exactly as its unmigrated run")
    return rec


def _migrate_when_queued(
    src: WorkerClient, dst: WorkerClient, rid: str, answer: Future[GenerateResp]
) -> Migration | None:
    """Migrate ``rid`` as soon as ``src`` has it queued (its hold is refused with 404 until then); None if it
    finished first."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return migrate_request(src, dst, rid)
        except UnknownMigrationError:
            if answer.done():
                return None
            if time.monotonic() > deadline:
                raise KvmoveError(f"request {rid} never became holdable on {src.url}") from None
            time.sleep(0.0005)


def _resources(clients: list[WorkerClient]) -> dict[str, Resources]:
    for c in clients:
        c.flush_cache()
    return {c.url: c.resources() for c in clients}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Reference:
    """Unmigrated greedy runs on an in-process worker with the servers' model and weights."""

    def __init__(self, cfg: SoakConfig) -> None:
        model = resolve_model(cfg.model)
        self.worker = RolloutWorker(
            model, seeded_checkpoint(model, cfg.seed).items(), WorkerConfig(num_pages=64, page_size=cfg.page_size)
        )
        self.params = SamplingParamsMsg(max_new_tokens=cfg.new_tokens, temperature=0)
        self.new_tokens = cfg.new_tokens

    def output(self, ids: list[int]) -> list[int]:
        self.worker.submit(Request("reference", ids, SamplingParams(max_new_tokens=self.new_tokens)))
        (done,) = self.worker.run_until_idle()
        return done.output_ids


def soak_rows(cfg: SoakConfig, results: list[SoakResult]) -> list[Row]:
    """One measured row per transport: bytes moved, wall time, migration latencies, resources before/after."""
    rows = []
    for r in results:
        seconds = [mg.seconds for mg in r.migrations if mg.ok]
        moved, link = sum(mg.bytes for mg in r.migrations), sum(mg.transport_seconds for mg in r.migrations)
        phases = {"migration_p50_s": statistics.median(seconds) if seconds else 0.0}
        phases["migration_max_s"] = max(seconds, default=0.0)
        extra = {
            "migrations": len(r.migrations),
            "failed": sum(not mg.ok for mg in r.migrations),
            "verified": r.verified,
            "problems": r.problems(cfg),
            "flat": not r.problems(cfg),
            "growth": r.growth(),
            "before": {u: res.model_dump() for u, res in r.before.items()},
            "after": {u: res.model_dump() for u, res in r.after.items()},
            "warmup": cfg.warmup,
            "abandoned_requests": r.rude.abandoned,
            "stalled_bodies": r.rude.stalled,
            "stalled_closed_by_server": r.rude.closed_by_server,
        }
        rows.append(
            Row(
                kind="measured",
                suite="soak",
                name=f"soak-{r.transport}-{len(r.migrations)}",
                model=cfg.model,
                transport=r.transport,
                bytes=moved,
                seconds=r.wall_seconds,
                gbps=moved / link / 1e9 if link > 0 else 0.0,
                phases=phases,
                extra=extra,
            )
        )
    return rows
