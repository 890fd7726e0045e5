"""Time to resume a migrated request against re-prefilling it, per prompt length, with the worker's own forward pass.

Run on a machine with one GPU (plain torch and kvmove; no Ray, NIXL or FastAPI needed):
``kvmove bench run --suite migration-gpu --results results/`` (``--layers N``: decoder layers of the slice).

Two rollout workers (``RolloutWorker``: paged KV pool, radix cache, scheduler, the reference forward pass with
SDPA attention) share one set of random weights of Qwen3-235B-A22B at full width (64 query heads, 4 KV heads of
128, hidden 4096, 128 experts top-8) for ``layers`` of its 94 decoder layers. Per prompt length P (whole pages):

- the source prefills P + 1 tokens; its K/V of the first P tokens is cached (and locked, as a migration does);
- **migrated**: the source's pages device -> host (D2H, ``HostKVPool.write_back``), host -> host into the target's
  host pool (``HostLink.read`` over a transport: ``local`` here, an in-process copy; NIXL between machines),
  host -> device into pages the target reserved (H2D, ``load_back``), inserted into the target's radix tree
  (``import_kv``); then the request is submitted there and one step computes its first token from the cached P
  tokens (the first decode). The protocol's HTTP round trips are not part of this figure (they are measured by
  ``kvmove migrate``);
- **re-prefill**: the same request on the target without the K/V: one step prefills P + 1 tokens.

Both first tokens are compared, and the migrated K/V is checked bit-exact against the source's. Medians of
``repeats`` runs after a warm-up. Both sides scale with the layer count (K/V bytes and compute are per layer), so a
slice of layers gives the full model's crossover up to the fixed costs (embedding, head), which both sides pay.
The network leg is also *modeled* at ``link_gbps`` (bytes / bandwidth replacing the in-process copy), labelled so.
Rows go to ``DIR/resume.parquet`` (measured) as they land.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvmove.bench.results import Row
from kvmove.errors import KvmoveError
from kvmove.kvcache import HostKVPool
from kvmove.kvcache.host_link import HostLink
from kvmove.models import resolve_model
from kvmove.models.config import ModelConfig
from kvmove.reference import (
    ReferenceModel,
    Request,
    RolloutWorker,
    SamplingParams,
    StepOutput,
    WorkerConfig,
)
from kvmove.reference.worker import build_models
from kvmove.transport.local import LocalTransport

Say = Callable[[str], None]
PROMPT_LENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class ResumeConfig:
    model: str = "qwen3-235b-a22b"
    layers: int = 8  # of the model's decoder layers (the attention shape is the full model's)
    prompt_lens: tuple[int, ...] = PROMPT_LENS
    repeats: int = 3
    page_size: int = 16
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0
    link_gbps: tuple[float, ...] = (25.0, 50.0)  # modeled network legs: 200 and 400 Gb/s


class ResumeTimes(NamedTuple):
    """Seconds of one migrated resume, by leg, and the first token it produced."""

    d2h: float
    transfer: float
    h2d: float
    insert: float
    first_decode: float
    token: int

    @property
    def total(self) -> float:
        return self.d2h + self.transfer + self.h2d + self.insert + self.first_decode


class Reprefill(NamedTuple):
    """Seconds of one re-prefill and the first token it produced."""

    seconds: float
    token: int


def random_models(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int) -> list[ReferenceModel]:
    """One tp=1 rank of ``cfg`` with random weights on ``device`` (norm weights 1): shape, not quality, matters."""
    models = build_models(cfg, (), dtype, 1, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in models[0].parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return models


class ResumeBench:
    """The two workers, their host pools linked by a transport, and one measurement per prompt length."""

    def __init__(self, cfg: ResumeConfig) -> None:
        self.cfg = cfg
        self.model = resolve_model(cfg.model, {"num_hidden_layers": cfg.layers})
        dtype = getattr(torch, cfg.dtype)
        models = random_models(self.model, dtype, cfg.device, cfg.seed)
        longest = max(cfg.prompt_lens) + 1
        pages = 3 * -(-longest // cfg.page_size) + 8  # the migrated prompt, the resumed request, slack
        wc = WorkerConfig(pages, cfg.page_size, 4, longest + cfg.page_size, dtype, "0", 1, cfg.device)
        self.source = RolloutWorker(self.model, (), wc, models=models)
        self.target = RolloutWorker(self.model, (), wc, models=models)
        pinned = cfg.device.startswith("cuda")
        self.source_link = HostLink(HostKVPool(self.source.pool.geometry, pages, pinned), LocalTransport())
        self.target_link = HostLink(HostKVPool(self.target.pool.geometry, pages, pinned), LocalTransport())

    def close(self) -> None:
        self.source_link.close()
        self.target_link.close()

    def measure(self, prompt_tokens: int) -> Row:
        """One row: medians of ``repeats`` migrated resumes and re-prefills of a ``prompt_tokens`` prompt."""
        cfg = self.cfg
        if prompt_tokens % cfg.page_size:
            raise KvmoveError(f"prompt length {prompt_tokens} is not whole pages of {cfg.page_size}")
        tokens = torch.randint(0, self.model.vocab_size, (prompt_tokens + 1,), generator=_gen(prompt_tokens)).tolist()
        key = f"p{prompt_tokens}"
        self.source.submit(Request(f"src-{prompt_tokens}", tokens, SamplingParams(max_new_tokens=1), extra_key=key))
        self.source.run_until_idle()
        held = self.source.export_request_kv(tokens=tokens[:prompt_tokens], extra_key=key, lock=True)
        try:
            resumes = [self._resume(tokens, key, held.pages, check=i == cfg.repeats) for i in range(cfg.repeats + 1)]
            prefills = [self._reprefill(tokens, key) for _ in range(cfg.repeats + 1)]
        finally:
            self.source.unlock_export(held)
            self.source.flush_cache()
        return self._row(prompt_tokens, held.pages.numel(), resumes[1:], prefills[1:])

    def _resume(self, tokens: list[int], key: str, src_pages: torch.Tensor, check: bool) -> ResumeTimes:
        """One migrated resume onto an empty target: the four legs, then the first decode."""
        self.target.flush_cache()
        n, prompt = src_pages.numel(), tokens[:-1]
        host_s, host_t = self.source_link.pool.alloc(n), self.target_link.pool.alloc(n)
        try:
            t = _Lap(self.cfg.device)
            pages = self.target.alloc_import_pages(n)
            self.source_link.pool.write_back(self.source.pool, src_pages, host_s)
            d2h = t.lap()
            self.target_link.read(
                self.source_link.transport.endpoint_info(), self.source_link.descs, host_s.tolist(), host_t.tolist()
            )
            transfer = t.lap()
            self.target_link.pool.load_back(self.target.pool, pages, host_t)
            h2d = t.lap()
            self.target.import_kv(prompt, key, pages)
            insert = t.lap()
            out = self._first_token(tokens, key, "resume")
            first = t.lap()
        finally:
            self.source_link.pool.free(host_s)
            self.target_link.pool.free(host_t)
        if out.prefill_tokens != 1:
            raise KvmoveError(f"the resumed request computed {out.prefill_tokens} tokens, not 1: K/V not reused")
        if check:
            _check_bit_exact(self.source, src_pages, self.target, pages)
        return ResumeTimes(d2h, transfer, h2d, insert, first, next(iter(out.new_tokens.values())))

    def _reprefill(self, tokens: list[int], key: str) -> Reprefill:
        self.target.flush_cache()
        t = _Lap(self.cfg.device)
        out = self._first_token(tokens, key + "-reprefill", "reprefill")
        seconds = t.lap()
        if out.prefill_tokens != len(tokens):
            raise KvmoveError(f"the re-prefill computed {out.prefill_tokens} of {len(tokens)} tokens")
        return Reprefill(seconds, next(iter(out.new_tokens.values())))

    def _first_token(self, tokens: list[int], key: str, rid: str) -> StepOutput:
        self.target.submit(Request(rid, tokens, SamplingParams(max_new_tokens=1), extra_key=key))
        out = self.target.step()
        if not out.finished:
            raise KvmoveError("the first step did not produce the request's token")
        return out

    def _row(self, prompt: int, pages: int, resumes: list[ResumeTimes], prefills: list[Reprefill]) -> Row:
        geo = self.target.pool.geometry
        nbytes = pages * geo.page_bytes * geo.num_buffers
        legs = {k: statistics.median(getattr(r, k) for r in resumes) for k in ResumeTimes._fields[:-1]}
        resume = statistics.median(r.total for r in resumes)
        reprefill = statistics.median(s for s, _ in prefills)
        copies = legs["d2h"] + legs["transfer"] + legs["h2d"]
        modeled = {
            f"{g:g}GBps": legs["d2h"] + nbytes / (g * 1e9) + legs["h2d"] + legs["insert"] + legs["first_decode"]
            for g in self.cfg.link_gbps
        }
        flops = prefill_flops(self.model, prompt + 1)
        return Row(
            kind="measured",
            suite="resume",
            name="resume vs re-prefill",
            model=f"{self.cfg.model} ({self.cfg.layers} of {self._full_layers()} layers)",
            transport="local",
            bytes=nbytes,
            seconds=resume,
            gbps=nbytes / copies / 1e9 if copies > 0 else 0.0,
            phases={**legs, "reprefill": reprefill},
            extra={
                "prompt_tokens": prompt,
                "layers": self.cfg.layers,
                "device": self.cfg.device,
                "resume_s": resume,
                "reprefill_s": reprefill,
                "speedup": reprefill / resume,
                "migration_wins": resume < reprefill,
                "same_first_token": all(r.token == t for r in resumes for _, t in prefills),
                "kv_bit_exact": True,  # NOTE: _check_bit_exact raised otherwise
                "reprefill_tflops": flops / reprefill / 1e12,
                "modeled_resume_s_by_link": modeled,
                "repeats": self.cfg.repeats,
            },
        )

    def _full_layers(self) -> int:
        return resolve_model(self.cfg.model).num_hidden_layers


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of prefilling ``tokens`` (attention projections, causal scores, active experts, router)."""
    h, d, q, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    proj = h * (q + 2 * kv) * d + q * d * h
    if cfg.num_experts:
        mlp = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + h * cfg.num_experts
    else:
        mlp = 3 * h * cfg.intermediate_size
    scores = 2 * q * d * tokens / 2  # QK^T and PV over half the context on average (causal)
    return float(2 * tokens * cfg.num_hidden_layers * (proj + mlp + scores) + 2 * h * cfg.vocab_size)


def crossover(rows: Sequence[Row]) -> int | None:
    """The shortest prompt from which migration resumes faster than re-prefill at every longer length measured."""
    ordered = sorted(rows, key=lambda r: r.extra["prompt_tokens"])
    winning = None
    for r in reversed(ordered):
        if not r.extra["migration_wins"]:
            break
        winning = r.extra["prompt_tokens"]
    return winning


def run(cfg: ResumeConfig, say: Say = print, record: Callable[[list[Row]], object] = lambda rows: None) -> list[Row]:
    """Warm up, then one row per prompt length (each recorded as it lands)."""
    bench = ResumeBench(cfg)
    try:
        bench.measure(min(cfg.prompt_lens))  # NOTE: warm-up: kernels, allocator, first-touch of host pages
        rows = []
        for p in cfg.prompt_lens:
            rows.append(bench.measure(p))
            e = rows[-1].extra
            say(
                f"  {p:>6} tokens: resume {e['resume_s'] * 1e3:8.2f} ms  re-prefill {e['reprefill_s'] * 1e3:8.2f} ms"
                f"  speedup {e['speedup']:6.2f}x  same token {e['same_first_token']}"
            )
            record(rows[-1:])
    finally:
        bench.close()
    return rows


class _Lap:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self._sync()
        self.t = time.perf_counter()

    def lap(self) -> float:
        self._sync()
        now = time.perf_counter()
        seconds, self.t = now - self.t, now
        return seconds

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _check_bit_exact(src: RolloutWorker, src_pages: torch.Tensor, dst: RolloutWorker, dst_pages: torch.Tensor) -> None:
    for a, b in zip(src.pool.page_views(), dst.pool.page_views(), strict=True):
        if not torch.equal(a[src_pages.to(a.device)], b[dst_pages.to(b.device)]):
            raise KvmoveError("the migrated K/V differs from the source's")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
