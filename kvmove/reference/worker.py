"""The rollout worker: one process; owns the model, the paged KV pool, the radix cache and the scheduler.

A step is three calls: schedule (admit by priority under the KV budget) -> run (one paged forward pass, one token
per request) -> postprocess (append, finish, cache finished K/V in the radix tree).

With ``tp_size > 1`` the worker holds that many tensor-parallel ranks, run together in this process: each rank its
own parameters (its heads and its slice of every MLP) and its own device KV pool holding its share of the KV heads.
The ranks share one scheduler, one page table and one radix tree (SGLang keeps identical copies of those on every
rank), so a page id names the same tokens on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvmove.errors import KvmoveError
from kvmove.kvcache import KVGeometry, KVPool, rank_heads
from kvmove.kvcache.allocator import PageIds
from kvmove.models.config import ModelConfig
from kvmove.reference.forward import check_supported
from kvmove.reference.kv_manager import ExportedKV, ImportResult, KVManager
from kvmove.reference.layers import RankContext
from kvmove.reference.loader import load_weights
from kvmove.reference.model import ReferenceModel
from kvmove.reference.request import Request, RequestError, UnknownRequestError
from kvmove.reference.runner import ModelRunner, RunResult
from kvmove.reference.scheduler import ScheduledBatch, Scheduler


@dataclass(frozen=True)
class WorkerConfig:
    """KV budget and batching limits of one worker."""

    num_pages: int = 64
    page_size: int = 16
    max_running: int = 16
    max_prefill_tokens: int = 1024
    dtype: torch.dtype = torch.float32
    weight_version: str = "0"
    tp_size: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_running", "max_prefill_tokens", "tp_size"):
            if getattr(self, name) < 1:
                raise KvmoveError(f"worker config: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class StepOutput:
    """What one step did: a token for each request it ran, the requests that finished, and those that raised while
    being stepped (``FinishReason.ERROR``; every other request of the batch ran on)."""

    new_tokens: dict[str, int] = field(default_factory=dict)
    finished: tuple[Request, ...] = ()
    prefill_tokens: int = 0
    decode_tokens: int = 0
    failed: tuple[Request, ...] = ()


@dataclass(frozen=True)
class WorkerStats:
    """Metrics of a worker; the token counters are totals since it started."""

    waiting_per_priority: dict[int, int]
    running: int
    free_pages: int
    used_pages: int
    cached_pages: int
    total_pages: int
    weight_version: str
    computed_tokens: int
    cached_tokens: int
    prefill_tokens: int
    decode_tokens: int


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> ReferenceModel:
    """A tp=1 reference model holding every layer, loaded from HF-named ``weights``."""
    return build_models(cfg, weights, dtype)[0]


def build_models(
    cfg: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    tp_size: int = 1,
    device: str = "cpu",
) -> list[ReferenceModel]:
    """The ``tp_size`` ranks of a reference model holding every layer, each loaded from HF-named ``weights``."""
    ranks = [
        ReferenceModel(
            cfg,
            RankContext(
                tp_size=tp_size, tp_rank=r, layers=tuple(range(cfg.num_hidden_layers)), dtype=dtype, device=device
            ),
        )
        for r in range(tp_size)
    ]
    check_supported(ranks)
    named = list(weights) if tp_size > 1 else weights
    for model in ranks:
        load_weights(model, named)
    return ranks


def rank_geometry(model: ReferenceModel, page_size: int, dtype: torch.dtype) -> KVGeometry:
    """The KV geometry of one rank: its share of the KV heads (``rank_heads``), every layer."""
    cfg, ctx = model.config, model.ctx
    shard = rank_heads(cfg.num_key_value_heads, ctx.tp_size, ctx.tp_rank)
    return KVGeometry(
        cfg.num_hidden_layers, shard.num, cfg.head_dim, page_size, dtype, shard.start, cfg.num_key_value_heads
    )


class RolloutWorker:
    """``models``: ranks built already (``build_models``; e.g. shared by two workers of one process), in which case
    ``weights`` is not read."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        config: WorkerConfig,
        *,
        models: list[ReferenceModel] | None = None,
    ) -> None:
        self.model_config, self.config = model_config, config
        self.models = models or build_models(model_config, weights, config.dtype, config.tp_size, config.device)
        check_supported(self.models)
        if len(self.models) != config.tp_size:
            raise KvmoveError(f"worker config: tp_size {config.tp_size} but {len(self.models)} model ranks")
        self.model = self.models[0]
        first = KVPool(rank_geometry(self.model, config.page_size, config.dtype), config.num_pages, config.device)
        self.pools = [first] + [
            KVPool(rank_geometry(m, config.page_size, config.dtype), config.num_pages, config.device, first.allocator)
            for m in self.models[1:]
        ]
        self.pool = first
        self.kv = KVManager(self.pool, config.weight_version)
        self.scheduler = Scheduler(self.kv, config.max_running, config.max_prefill_tokens)
        self.runner = ModelRunner(self.models, self.pools)
        self._prefill_tokens = self._decode_tokens = self._cached_tokens = 0

    @property
    def tp_size(self) -> int:
        return len(self.models)

    @property
    def weight_version(self) -> str:
        return self.kv.weight_version

    @property
    def is_idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.num_waiting

    def submit(self, req: Request) -> None:
        """Queue ``req``; RequestError if it is malformed, its rid is taken, or it could never fit in the pool."""
        req.validate(self.model_config.vocab_size)
        if self.scheduler.get(req.rid) is not None:
            raise RequestError(f"request {req.rid!r} is already waiting or running")
        if self.kv.pages_for(req.max_kv_tokens) > self.pool.num_pages:
            raise RequestError(
                f"request {req.rid!r} needs {self.kv.pages_for(req.max_kv_tokens)} KV pages, "
                f"the pool has {self.pool.num_pages}"
            )
        self.scheduler.add(req)

    def step(self) -> StepOutput:
        batch = self.scheduler.schedule()
        if not batch:
            return StepOutput()
        run = self._run(batch)
        failed = tuple(self.scheduler.fail(rid, error) for rid, error in run.failed.items())
        prefill = sum(r.num_tokens - r.cached_tokens for r in batch.prefill)
        self._prefill_tokens += prefill
        self._decode_tokens += len(batch.decode)
        self._cached_tokens += sum(r.cached_tokens for r in batch.prefill)
        finished = self.scheduler.postprocess(batch, run.tokens)
        return StepOutput(run.tokens, tuple(finished), prefill, len(batch.decode), failed)

    def _run(self, batch: ScheduledBatch) -> RunResult:
        """The batch in one forward pass; if that raises (nothing advanced yet), each request alone, so that only
        a request which raises by itself fails."""
        try:
            return self.runner.run(batch, self.scheduler.allocs)
        except Exception:
            result = RunResult({}, {})
            for req in batch.requests:
                try:
                    alone = self.runner.run(ScheduledBatch((req,), ()), self.scheduler.allocs)
                except Exception as exc:
                    result.failed[req.rid] = f"step failed: {exc!r}"
                    continue
                result.tokens.update(alone.tokens)
                result.failed.update(alone.failed)
            return result

    def run_until_idle(self, max_steps: int = 100_000) -> list[Request]:
        """Step until nothing waits or runs; returns the requests finished meanwhile, in finishing order."""
        finished: list[Request] = []
        for _ in range(max_steps):
            if self.is_idle:
                return finished
            out = self.step()
            if not out.new_tokens and not out.failed:
                raise KvmoveError("worker is stuck: requests wait but none can be admitted")
            finished.extend(out.finished + out.failed)
        raise KvmoveError(f"worker not idle after {max_steps} steps")

    def abort(self, rid: str) -> Request:
        """Remove a waiting or running request (its computed whole pages stay cached); UnknownRequestError if none."""
        return self.scheduler.abort(rid)

    def get(self, rid: str) -> Request:
        req = self.scheduler.get(rid)
        if req is None:
            raise UnknownRequestError(f"no waiting or running request with rid {rid!r}")
        return req

    # -- weights -------------------------------------------------------------------------------------------------

    def set_weight_version(self, version: str) -> None:
        """New K/V is cached under ``version``; K/V of other versions is never matched again (unlocked: evicted)."""
        if version == self.weight_version:
            raise KvmoveError(f"weight version is already {version!r}")
        self.kv.set_weight_version(version)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Load new HF-named weights in place (every rank) and switch to ``version``."""
        named = list(weights) if self.tp_size > 1 else weights
        for model in self.models:
            load_weights(model, named)
        self.set_weight_version(version)

    # -- migration hooks -----------------------------------------------------------------------------------------

    def export_request_kv(
        self, rid: str | None = None, tokens: list[int] | None = None, extra_key: str | None = None, lock: bool = False
    ) -> ExportedKV:
        """Pages holding computed K/V, whole pages only: of running request ``rid`` (valid while it runs), or of the
        cached prefix of ``tokens`` under ``extra_key`` (``lock`` pins it until ``unlock_export``)."""
        if (rid is None) == (tokens is None):
            raise KvmoveError("export_request_kv: pass exactly one of rid or tokens")
        if rid is not None:
            req = self.get(rid)
            alloc = self.scheduler.allocs.get(rid)
            if alloc is None:
                raise UnknownRequestError(f"request {rid!r} is not running: it has no K/V yet")
            return self.kv.export_alloc(alloc, req.all_ids[: req.kv_len], req.extra_key)
        assert tokens is not None
        return self.kv.export_cached(list(tokens), extra_key, lock)

    def unlock_export(self, exported: ExportedKV) -> None:
        self.kv.unlock_export(exported)

    def alloc_import_pages(self, num_pages: int) -> torch.Tensor:
        """Reserve pool pages for K/V about to be written from a peer (evicts LRU cache as needed)."""
        return self.kv.alloc_import(num_pages)

    def free_import_pages(self, pages: PageIds) -> None:
        self.kv.free_import(pages)

    def import_kv(self, tokens: list[int], extra_key: str | None, pages: PageIds) -> ImportResult:
        """Cache ``pages`` (reserved by ``alloc_import_pages``, already written) as the K/V of the last whole pages
        of ``tokens`` (whole pages); the pages before them must be cached here already (prefix dedup).

        A request submitted afterwards whose tokens extend ``tokens`` (e.g. ``Request.continuation``) reuses them.
        """
        return self.kv.import_kv(list(tokens), extra_key, pages)

    def flush_cache(self) -> int:
        """Evict every unlocked cached page (freed); returns how many. KvmoveError unless the worker is idle."""
        if not self.is_idle:
            raise KvmoveError("cannot flush the cache while requests wait or run")
        pages = self.kv.tree.evict(self.kv.tree.total_pages).pages
        self.pool.free(pages)
        return pages.numel()

    # -- metrics, invariants -------------------------------------------------------------------------------------

    def stats(self) -> WorkerStats:
        return WorkerStats(
            waiting_per_priority=self.scheduler.queue_lengths(),
            running=len(self.scheduler.running),
            free_pages=self.pool.free_pages,
            used_pages=self.pool.used_pages,
            cached_pages=self.kv.tree.total_pages,
            total_pages=self.pool.num_pages,
            weight_version=self.weight_version,
            computed_tokens=self._prefill_tokens + self._decode_tokens,
            cached_tokens=self._cached_tokens,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
        )

    def check_integrity(self) -> None:
        """Every page has one owner (free, cached, a running request, an import); no lock leaks when idle; every
        rank's pool keeps its buffers and shares the page table."""
        self.kv.check_integrity()
        for pool in self.pools[1:]:
            pool.check_integrity()
            if pool.allocator is not self.pool.allocator:
                raise KvmoveError("tensor-parallel ranks no longer share one page table")
        if set(self.scheduler.running) != set(self.scheduler.allocs):
            raise KvmoveError("scheduler: running requests and KV allocations disagree")
