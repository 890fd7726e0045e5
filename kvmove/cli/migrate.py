"""`kvmove migrate`: start workers on loopback, drive a prioritized workload, migrate starving requests, verify."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvmove.cli import render, streams
from kvmove.cli.options import JsonOpt, KVTransport, ModelOpt, NoRecordOpt, ResultsOpt
from kvmove.cli.serve import TransportOpt, warn_fallback
from kvmove.errors import JobFailed, KvmoveError

if TYPE_CHECKING:
    from kvmove.server.config import ServerConfig

WorkersOpt = Annotated[int, typer.Option("--workers", min=2, help="Worker servers to start on loopback.")]
RequestsOpt = Annotated[int, typer.Option("--requests", min=1, help="High-priority requests (one GRPO group).")]
PromptLenOpt = Annotated[int, typer.Option("--prompt-len", min=1, help="Tokens of the group's shared prompt.")]
NewTokensOpt = Annotated[int, typer.Option("--new-tokens", min=1, help="Tokens each high request generates.")]
NumPagesOpt = Annotated[int, typer.Option("--num-pages", min=8, help="KV pages per worker.")]
PageSizeOpt = Annotated[int, typer.Option("--page-size", min=1, help="Tokens per KV page.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of weights and prompts.")]
BaselineOpt = Annotated[
    bool, typer.Option("--baseline/--no-baseline", help="Also run the workload without migration (p50/p99).")
]


class Routes(StrEnum):
    """kvmove: hold/release hand-over and migration abort; sglang: only the SGLang fork's routes."""

    kvmove = "kvmove"
    sglang = "sglang"


RoutesOpt = Annotated[
    Routes,
    typer.Option(
        "--routes",
        help="kvmove: hold/release hand-over and migration abort; sglang: only the SGLang fork's five migration "
        "routes, /abort_request and /generate (the workers start with --no-kvmove-routes).",
    ),
]
TpOpt = Annotated[
    str, typer.Option("--tp", help="Tensor-parallel ranks per worker, one value or one per worker: 2 or 2,1.")
]
MeasureLinkOpt = Annotated[
    bool, typer.Option("--measure-link/--no-measure-link", help="Measure the raw transport bandwidth too.")
]


def migrate(
    workers: WorkersOpt = 2,
    requests: RequestsOpt = 4,
    prompt_len: PromptLenOpt = 64,
    new_tokens: NewTokensOpt = 24,
    model: ModelOpt = "qwen3-tiny",
    num_pages: NumPagesOpt = 128,
    page_size: PageSizeOpt = 16,
    transport: TransportOpt = KVTransport.auto,
    seed: SeedOpt = 1,
    baseline: BaselineOpt = True,
    measure_link: MeasureLinkOpt = True,
    routes: RoutesOpt = Routes.kvmove,
    tp: TpOpt = "1",
    as_json: JsonOpt = False,
    results: ResultsOpt = None,
    no_record: NoRecordOpt = False,
) -> None:
    """Migrate starving high-priority requests with their KV between loopback workers, and verify them.

    Starts N workers (`kvmove serve` subprocesses on 127.0.0.1), queues high-priority requests behind KV pressure on
    one, migrates them with their K/V to the others, and checks every output against an unmigrated greedy run.

    Exit codes: 0 every request continued identically; 1 one diverged or a worker failed its integrity check;
    2 bad usage or input; 130 interrupted (workers stopped).

    Example: kvmove migrate --workers 2 --requests 4 --prompt-len 64 --json

    Example: kvmove migrate --prompt-len 256 --results results/   # rows for migration_latency.png
    """
    from kvmove.bench.migration_report import rows_for, summarize  # NOTE: needs the optional `serve` extra
    from kvmove.bench.migration_workload import WorkloadConfig

    tps = _tp_sizes(tp, workers)
    cfg = WorkloadConfig(
        requests=requests,
        prompt_len=prompt_len,
        high_new_tokens=new_tokens,
        page_size=page_size,
        model=model,
        seed=seed,
        routes=routes.value,
    )
    _check_fit(cfg, num_pages)
    choice = warn_fallback(transport.value)
    server = _server(cfg, num_pages, choice.name)
    with streams.progress() as say:
        runs = _workloads([replace(server, tp_size=n) for n in tps], cfg, baseline, say)
        link = _link_gbps(choice.name, runs[0], say) if measure_link else None
    lines = summarize(runs, link, choice)
    _render(lines, as_json)
    if results is not None and not no_record:
        from kvmove.bench.results import append_rows

        path = append_rows(results, "migration", rows_for(lines, model, choice.name, prompt_len))
        streams.note(f"{len(lines)} measured rows appended to {path}")
    _check_continued(lines)


def _server(cfg: Any, num_pages: int, transport: str) -> ServerConfig:
    """Every worker's settings (its tensor-parallel size aside): migration on, this run's admin key only."""
    from kvmove.server.config import ServerConfig

    return ServerConfig(
        model=cfg.model,
        seed=cfg.seed,
        num_pages=num_pages,
        page_size=cfg.page_size,
        transport=transport,
        enable_kv_migration=True,
        max_prefill_tokens=4096,
        kvmove_routes=cfg.routes == Routes.kvmove.value,
        admin_api_key=secrets.token_urlsafe(24),  # NOTE: the workers trust only this run's controller and each other
    )


def _check_continued(lines: list[dict[str, Any]]) -> None:
    """JobFailed naming every request (or the summary) that did not continue identically or failed integrity."""
    bad = [line.get("rid", "summary") for line in lines if not (line["verified"] and line["integrity_ok"])]
    if bad:
        raise JobFailed(f"not continued identically or integrity check failed: {', '.join(map(str, bad))}")


def _render(lines: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        render.json_lines(lines)
    else:
        for line in lines:
            print(_text(line), file=streams.out())


def _check_fit(cfg: Any, num_pages: int) -> None:
    need = -(-(cfg.prompt_len + cfg.suffix_len + cfg.high_new_tokens) // cfg.page_size)
    if need * cfg.requests > num_pages - 1:
        raise KvmoveError(f"{cfg.requests} requests of {need} pages do not fit in --num-pages {num_pages}")


def _workloads(servers: list[Any], cfg: Any, baseline: bool, say: Callable[[str], None]) -> list[Any]:
    """The workload with migration (and without, as a baseline) on fresh loopback servers, one per config."""
    from kvmove.bench.migration_workload import run_workload
    from kvmove.migration.client import WorkerClient
    from kvmove.ports import free_port
    from kvmove.server.launch import LocalCluster

    configs = [replace(c, port=free_port()) for c in servers]
    say(f"starting {len(configs)} workers ({configs[0].model}, KV over {configs[0].transport})")
    with tempfile.TemporaryDirectory(prefix="kvmove-migrate-") as logs, LocalCluster(configs, Path(logs)) as cluster:
        clients = [WorkerClient(u, timeout=cfg.deadline_s, api_key=configs[0].admin_api_key) for u in cluster.urls]
        with ThreadPoolExecutor(max_workers=2 * cfg.requests + 8) as pool:
            say(f"workload with migration: {cfg.requests} high-priority requests, prompt {cfg.prompt_len} tokens")
            runs = [run_workload(clients, cfg, True, pool)]
            if baseline:
                say("the same workload without migration (baseline)")
                runs.append(run_workload(clients, cfg, False, pool))
        for c in clients:
            c.close()
    return runs


def _tp_sizes(text: str, workers: int) -> list[int]:
    """``--tp``: one size for every worker, or one per worker."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise KvmoveError(f"--tp takes integers separated by commas, not {text!r}") from None
    if len(sizes) == 1:
        sizes *= workers
    if len(sizes) != workers or min(sizes) < 1:
        raise KvmoveError(f"--tp needs one size >= 1 or {workers} of them (one per worker), got {text!r}")
    return sizes


def _link_gbps(transport: str, run: Any, say: Callable[[str], None]) -> float:
    from kvmove.transport.bandwidth import measure_bandwidth

    say(f"raw {transport} bandwidth")
    nbytes = max([mg.bytes for mg in run.migrations] + [1 << 20])
    return measure_bandwidth(transport, nbytes, repeats=3, processes="process").gb_per_s


def _text(line: dict[str, Any]) -> str:
    keys = ("kind", "rid", "migrations", "finished_before_move", "verified", "bytes", "seconds", "gbps", "integrity_ok",
            "transport")  # fmt: skip
    return "  ".join(f"{k}={line[k]}" for k in keys if k in line)
