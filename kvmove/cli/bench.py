"""`kvmove bench`: run benchmark suites (`run`) and render every recorded row (`report`, in kvmove.cli.report).

Rows are recorded only where asked (``--results DIR``): the rows in the repository's results/ are written on
purpose (``kvmove bench run --suite sync --results results/``), so trying a suite leaves the work tree clean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import typer

from kvmove.cli import render, streams
from kvmove.cli import report as report_cli
from kvmove.cli import simulate as simulate_cli
from kvmove.cli.options import BenchTransportOpt, JsonOpt, ResultsOpt
from kvmove.errors import JobFailed, KvmoveError
from kvmove.transport import AUTO

if TYPE_CHECKING:
    from kvmove.bench.results import Labels, Row

app = typer.Typer(no_args_is_help=True, help="Benchmarks: measured and simulated rows in results/.")


class Suite(StrEnum):
    """plan: full-size plans; sync: raw link + every strategy; quick: sync; full: plan + sync; gpu: two GPUs;
    vllm: reference engine and vLLM side by side; decode-latency: decode steps with and without migrations into a
    loaded worker; migration-gpu: resume vs re-prefill on one GPU; soak: what servers hold after many migrations;
    gpu-fp8: BF16 vs FP8 engine, v3, one or two GPUs; delta: a delta sync's detection, encoding and apply per
    realistic training step (one GPU, or a small model on CPU); micro: the simulator's quantize and collective costs
    (two GPUs; on CPU its rows set no cost)."""

    plan = "plan"
    sync = "sync"
    quick = "quick"
    full = "full"
    gpu = "gpu"
    vllm = "vllm"
    decode_latency = "decode-latency"
    migration_gpu = "migration-gpu"
    soak = "soak"
    gpu_fp8 = "gpu-fp8"
    delta = "delta"
    micro = "micro"


@app.command("run")
@streams.owns_stdout
def run(
    suite: Annotated[Suite, typer.Option("--suite", help="Which benchmark to run.")] = Suite.quick,
    results: ResultsOpt = None,
    transport: BenchTransportOpt = AUTO,
    syncs: Annotated[int, typer.Option("--syncs", min=1, help="Syncs per strategy in the sync suite.")] = 3,
    layers: Annotated[
        int,
        typer.Option(
            "--layers",
            min=0,
            help="gpu, delta, migration-gpu suites: decoder layers of the slice (0: gpu 8 on two GPUs, 2 on one; "
            "delta 8 on a GPU; migration-gpu 8).",
        ),
    ] = 0,
    gpus: Annotated[
        int, typer.Option("--gpus", min=0, max=2, help="gpu suite: GPUs to use (0: all, at most two).")
    ] = 0,
    as_json: JsonOpt = False,
    migrations: Annotated[
        int,
        typer.Option(
            "--migrations", min=1, help="Migrations per transport in the soak suite (after a warm-up of min(20, N/10))."
        ),
    ] = 200,
) -> None:
    """Run a benchmark suite; print its rows and, with --results DIR, append them to DIR/<suite>.parquet.

    The soak suite (--suite soak [--transport nixl|http] [--migrations N]) moves K/V N times back and forth (every
    10th time a live request, continued on the other side) between two `kvmove serve` processes per transport and
    reports what each server holds (fds, RSS, threads, pages, locks, pending migrations) after a warm-up and at the
    end; it exits 1 if anything grew.

    Example: kvmove bench run --suite plan

    Example: kvmove bench run --suite sync --syncs 3 --results results/   # the rows docs/benchmarks.md quotes
    """
    if suite is Suite.gpu:
        _gpu_syncs(results, transport, GpuShape(syncs, layers, gpus), as_json)
        return
    if suite is Suite.gpu_fp8:
        _gpu_fp8(results, transport, GpuShape(syncs, layers, 0), as_json)
        return
    if suite is Suite.delta:
        _delta(results, layers, as_json)
        return
    if suite is Suite.migration_gpu:
        _resume(results, layers, as_json)
        return
    with streams.progress() as say:
        if suite in (Suite.plan, Suite.full):
            from kvmove.bench.plans import plan_rows

            say("full-size plans of the published setups")
            _show("plan", plan_rows(), results, as_json)
        if suite in (Suite.sync, Suite.quick, Suite.full):
            from kvmove.bench.syncs import summarize, sync_suite

            rows = sync_suite(transport=transport, syncs=syncs, progress=say)
            _show("transport", [r for r in rows if r.suite == "transport"], results, as_json)
            _show("sync", [r for r in rows if r.suite == "sync"], results, as_json)
            if not as_json:
                render.summary(summarize(rows))
        if suite is Suite.decode_latency:
            from kvmove.bench.decode_latency import DecodeLatencyConfig, decode_latency

            row = decode_latency(DecodeLatencyConfig(transport=transport), say=say)
            _show("decode_latency", [row], results, as_json)
        if suite is Suite.soak:
            _soak(transport, migrations, results, as_json, say)
        if suite is Suite.micro:
            from kvmove.bench.micro import micro_labels, micro_rows

            say("micro-benchmarks: FP8 block quantize, a 4 KiB all-gather between two ranks")
            _show("micro", micro_rows(), results, as_json, micro_labels())
        if suite is Suite.vllm:
            from kvmove.bench.syncs import vllm_suite

            _show("vllm", vllm_suite(transport=transport, syncs=syncs, progress=say), results, as_json)


def _show(suite: str, rows: list[Row], results: Path | None, as_json: bool, labels: Labels | None = None) -> None:
    """Append ``rows`` to ``results/<suite>.parquet`` when asked (labelled ``labels``, default: this machine), say
    where they went, and print them."""
    where = None
    if results is not None and rows:
        from kvmove.bench.results import append_rows

        where = append_rows(results, suite, rows, labels)
    _print_rows(suite, rows, where, as_json)


def _print_rows(suite: str, rows: list[Row], where: Path | None, as_json: bool) -> None:
    """Say where ``rows`` went (``where``: the file they were appended to, None: not recorded) and print them (a
    table, or JSON lines)."""
    if rows and where is not None:
        streams.note(f"{len(rows)} {suite} rows appended to {where}")
    elif rows:
        streams.note(f"{len(rows)} {suite} rows not recorded (rows are appended only with --results DIR)")
    if as_json:
        render.json_lines(asdict(r) for r in rows)
    else:
        render.bench_rows(rows, where)


def _resume(results: Path | None, layers: int, as_json: bool) -> None:
    """Resume vs re-prefill on one GPU, plain torch (kvmove.bench.resume; its CPU twin runs in the tests): rows
    recorded as they land, labelled with the GPU."""
    from dataclasses import replace

    import torch

    from kvmove.bench.results import Labels, append_rows, git_commit, hardware_label, versions
    from kvmove.bench.resume import ResumeConfig, crossover, run

    if not torch.cuda.is_available():
        raise KvmoveError("this suite needs a CUDA GPU (its CPU twin: ResumeConfig(device='cpu') in the tests)")
    if results is None:
        raise KvmoveError("a GPU suite records its rows as it goes: give --results DIR (e.g. --results results/)")
    cfg = replace(ResumeConfig(), layers=layers) if layers else ResumeConfig()
    labels = Labels(hardware_label(cfg.device), versions(), git_commit())
    with streams.progress() as say:
        say(f"resume vs re-prefill: {cfg.model}, {cfg.layers} layers, {cfg.device}, {cfg.dtype}")
        rows = run(cfg, say, lambda new: append_rows(results, "resume", new, labels))
    won = crossover(rows)
    streams.note(f"migration resumes faster than re-prefill from {won} tokens on" if won else "re-prefill wins")
    _print_rows("resume", rows, results / "resume.parquet", as_json)  # recorded as they landed


class GpuShape(NamedTuple):
    """What ``--syncs``, ``--layers`` and ``--gpus`` ask of the gpu suite (0: the default)."""

    syncs: int
    layers: int
    gpus: int


def _gpu_syncs(results: Path | None, transport: str, shape: GpuShape, as_json: bool) -> None:
    """One or two GPUs, no Ray (kvmove.bench.gpu): ceilings, the weight-sync matrix (every layout, placement,
    strategy and transport: ``auto`` is cuda-ipc, nixl where installed, nccl; or the one given) with a ceiling per
    cell, KV copies; rows recorded as they land, labelled with the GPU."""
    from dataclasses import replace

    import torch

    from kvmove.bench.gpu import GpuSuite, gpu_suite

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = shape.gpus or min(have, 2)
    if have < max(gpus, 1):
        raise KvmoveError(
            f"this suite needs {max(gpus, 1)} CUDA GPU(s), {have} visible (its CPU twin: GpuSuite.cpu_twin())"
        )
    if results is None:
        raise KvmoveError("a GPU suite records its rows as it goes: give --results DIR (e.g. --results results/)")
    devices = tuple(f"cuda:{i}" for i in range(gpus))
    layers = shape.layers or (8 if gpus > 1 else 2)  # NOTE: one GPU holds the trainer's and the engine's copies
    suite = GpuSuite(syncs=shape.syncs, layers=layers, devices=devices)
    _gpu_rows(gpu_suite, suite if transport == "auto" else replace(suite, transports=(transport,)), results, as_json)


def _gpu_fp8(results: Path | None, transport: str, shape: GpuShape, as_json: bool) -> None:
    """BF16 -> BF16 and BF16 -> FP8 v3 syncs of the same slice on one or two GPUs (kvmove.bench.gpu_fp8)."""
    from dataclasses import replace

    import torch

    from kvmove.bench.gpu import GpuSuite
    from kvmove.bench.gpu_fp8 import fp8_devices, gpu_fp8_suite

    if not torch.cuda.is_available():
        raise KvmoveError("this suite needs a CUDA GPU (its CPU twin: kvmove.bench.gpu_fp8 on cpu devices)")
    if results is None:
        raise KvmoveError("a GPU suite records its rows as it goes: give --results DIR (e.g. --results results/)")
    suite = GpuSuite(syncs=shape.syncs, devices=fp8_devices(), transports=("cuda-ipc", "nccl", "nixl"))
    if shape.layers:
        suite = replace(suite, layers=shape.layers)
    _gpu_rows(
        gpu_fp8_suite, suite if transport == "auto" else replace(suite, transports=(transport,)), results, as_json
    )


def _delta(results: Path | None, layers: int, as_json: bool) -> None:
    """kvmove.bench.delta on cuda:0 (the Qwen3-235B-A22B slice, ``layers`` of it: 0 is 8, 42.3 GB) or, without a
    GPU, on CPU (qwen3-moe-small, every layer)."""
    from dataclasses import replace

    import torch

    from kvmove.bench.delta import DeltaBench, delta_bench

    bench = DeltaBench() if torch.cuda.is_available() else DeltaBench.cpu_twin("qwen3-moe-small", 6)
    if layers:
        bench = replace(bench, layers=layers)
    with streams.progress() as say:
        rows = delta_bench(bench, say)
    _show("delta", rows, results, as_json)


def _gpu_rows(run_suite: Any, suite: Any, results: Path, as_json: bool) -> None:
    """Run a GPU suite, recording its rows to ``results/gpu.parquet`` as they land, labelled with the GPUs it
    used."""
    import torch

    from kvmove.bench.results import Labels, append_rows, git_commit, hardware_label, versions

    gpus = len(set(suite.devices))
    hardware = f"{hardware_label('cuda').rsplit(' x', 1)[0]} x{gpus}"  # the GPUs this run used
    labels = Labels(hardware, {**versions(), "cuda": str(torch.version.cuda)}, git_commit())
    with streams.progress() as say:
        rows = run_suite(suite, lambda new: append_rows(results, "gpu", new, labels) if new else None, say)
    _print_rows("gpu", rows, results / "gpu.parquet", as_json)  # recorded as they landed


def _soak(transport: str, migrations: int, results: Path | None, as_json: bool, say: Callable[[str], None]) -> None:
    from kvmove.bench.soak import SoakConfig, run_soak, soak_rows, soak_transports

    chosen = () if transport == "auto" else (transport,)
    cfg = SoakConfig(migrations=migrations, warmup=min(20, migrations // 10), transports=chosen)
    runs = []
    for name in soak_transports(cfg):
        say(f"soak over {name}: {cfg.warmup} warm-up + {migrations} migrations between two kvmove serve processes")
        runs.append(run_soak(cfg, name))
    rows = soak_rows(cfg, runs)
    where = None
    if results is not None:
        from kvmove.bench.results import append_rows

        where = append_rows(results, "soak", rows)
        streams.note(f"{len(rows)} soak rows appended to {where}")
    if as_json:
        render.json_lines(asdict(r) for r in rows)
    else:
        render.soak_table(rows, where)
    problems = [f"{r.transport}: {p}" for r in runs for p in r.problems(cfg)]
    if problems:
        raise JobFailed(f"soak not flat: {'; '.join(problems[:5])}")


app.command("report")(streams.owns_stdout(report_cli.report))
app.command("simulate")(streams.owns_stdout(simulate_cli.simulate))
