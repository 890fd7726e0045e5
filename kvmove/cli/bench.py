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
    SUITES[suite](Asked(results, transport, syncs, layers, gpus, as_json, migrations))


class Asked(NamedTuple):
    """What ``bench run`` was asked; each suite reads its own options."""

    results: Path | None
    transport: str
    syncs: int
    layers: int
    gpus: int
    as_json: bool
    migrations: int


def _plan(a: Asked) -> None:
    """Full-size plans of the published setups (kvmove.bench.plans)."""
    from kvmove.bench.plans import plan_rows

    with streams.progress() as say:
        say("full-size plans of the published setups")
        _show("plan", plan_rows(), a.results, a.as_json)


def _syncs(a: Asked) -> None:
    """The raw link, then every strategy's syncs (kvmove.bench.syncs), and their summary."""
    from kvmove.bench.syncs import summarize, sync_suite

    with streams.progress() as say:
        rows = sync_suite(transport=a.transport, syncs=a.syncs, progress=say)
        _show("transport", [r for r in rows if r.suite == "transport"], a.results, a.as_json)
        _show("sync", [r for r in rows if r.suite == "sync"], a.results, a.as_json)
        if not a.as_json:
            render.summary(summarize(rows))


def _full(a: Asked) -> None:
    _plan(a)
    _syncs(a)


def _decode_latency(a: Asked) -> None:
    """Decode steps with and without migrations into a loaded worker (kvmove.bench.decode_latency)."""
    from kvmove.bench.decode_latency import DecodeLatencyConfig, decode_latency

    with streams.progress() as say:
        row = decode_latency(DecodeLatencyConfig(transport=a.transport), say=say)
        _show("decode_latency", [row], a.results, a.as_json)


def _micro(a: Asked) -> None:
    """The simulator's quantize and collective costs (kvmove.bench.micro), labelled with this machine."""
    from kvmove.bench.micro import micro_labels, micro_rows

    with streams.progress() as say:
        say("micro-benchmarks: FP8 block quantize, a 4 KiB all-gather between two ranks")
        _show("micro", micro_rows(), a.results, a.as_json, micro_labels())


def _vllm(a: Asked) -> None:
    """The reference engine and vLLM side by side (kvmove.bench.syncs.vllm_suite)."""
    from kvmove.bench.syncs import vllm_suite

    with streams.progress() as say:
        _show("vllm", vllm_suite(transport=a.transport, syncs=a.syncs, progress=say), a.results, a.as_json)


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


def _resume(a: Asked) -> None:
    """Resume vs re-prefill on one GPU, plain torch (kvmove.bench.resume; its CPU twin runs in the tests): rows
    recorded as they land, labelled with the GPU."""
    from dataclasses import replace

    import torch

    from kvmove.bench.results import Labels, append_rows, git_commit, hardware_label, versions
    from kvmove.bench.resume import ResumeConfig, crossover, run

    if not torch.cuda.is_available():
        raise KvmoveError("this suite needs a CUDA GPU (its CPU twin: ResumeConfig(device='cpu') in the tests)")
    results = _recorded(a)
    cfg = replace(ResumeConfig(), layers=a.layers) if a.layers else ResumeConfig()
    labels = Labels(hardware_label(cfg.device), versions(), git_commit())
    with streams.progress() as say:
        say(f"resume vs re-prefill: {cfg.model}, {cfg.layers} layers, {cfg.device}, {cfg.dtype}")
        rows = run(cfg, say, lambda new: append_rows(results, "resume", new, labels))
    won = crossover(rows)
    streams.note(f"migration resumes faster than re-prefill from {won} tokens on" if won else "re-prefill wins")
    _print_rows("resume", rows, results / "resume.parquet", a.as_json)  # recorded as they landed


def _recorded(a: Asked) -> Path:
    """``--results``, which a GPU suite needs: it records its rows as they land."""
    if a.results is None:
        raise KvmoveError("a GPU suite records its rows as it goes: give --results DIR (e.g. --results results/)")
    return a.results


def _gpu_syncs(a: Asked) -> None:
    """One or two GPUs, no Ray (kvmove.bench.gpu): ceilings, the weight-sync matrix (every layout, placement,
    strategy and transport: ``auto`` is cuda-ipc, nixl where installed, nccl; or the one given) with a ceiling per
    cell, KV copies; rows recorded as they land, labelled with the GPU."""
    from dataclasses import replace

    import torch

    from kvmove.bench.gpu import GpuSuite, gpu_suite

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = a.gpus or min(have, 2)
    if have < max(gpus, 1):
        raise KvmoveError(
            f"this suite needs {max(gpus, 1)} CUDA GPU(s), {have} visible (its CPU twin: GpuSuite.cpu_twin())"
        )
    results = _recorded(a)
    devices = tuple(f"cuda:{i}" for i in range(gpus))
    layers = a.layers or (8 if gpus > 1 else 2)  # NOTE: one GPU holds the trainer's and the engine's copies
    suite = GpuSuite(syncs=a.syncs, layers=layers, devices=devices)
    chosen = suite if a.transport == "auto" else replace(suite, transports=(a.transport,))
    _gpu_rows(gpu_suite, chosen, results, a.as_json)


def _gpu_fp8(a: Asked) -> None:
    """BF16 -> BF16 and BF16 -> FP8 v3 syncs of the same slice on one or two GPUs (kvmove.bench.gpu_fp8)."""
    from dataclasses import replace

    import torch

    from kvmove.bench.gpu import GpuSuite
    from kvmove.bench.gpu_fp8 import fp8_devices, gpu_fp8_suite

    if not torch.cuda.is_available():
        raise KvmoveError("this suite needs a CUDA GPU (its CPU twin: kvmove.bench.gpu_fp8 on cpu devices)")
    results = _recorded(a)
    suite = GpuSuite(syncs=a.syncs, devices=fp8_devices(), transports=("cuda-ipc", "nccl", "nixl"))
    if a.layers:
        suite = replace(suite, layers=a.layers)
    chosen = suite if a.transport == "auto" else replace(suite, transports=(a.transport,))
    _gpu_rows(gpu_fp8_suite, chosen, results, a.as_json)


def _delta(a: Asked) -> None:
    """kvmove.bench.delta on cuda:0 (the Qwen3-235B-A22B slice, ``layers`` of it: 0 is 8, 42.3 GB) or, without a
    GPU, on CPU (qwen3-moe-small, every layer)."""
    from dataclasses import replace

    import torch

    from kvmove.bench.delta import DeltaBench, delta_bench

    bench = DeltaBench() if torch.cuda.is_available() else DeltaBench.cpu_twin("qwen3-moe-small", 6)
    if a.layers:
        bench = replace(bench, layers=a.layers)
    with streams.progress() as say:
        rows = delta_bench(bench, say)
    _show("delta", rows, a.results, a.as_json, _labels(bench.device))


def _labels(device: str) -> Labels:
    """This machine's labels, its hardware named by the device the suite ran on (a GPU's, not the host CPU's)."""
    from kvmove.bench.results import Labels, git_commit, hardware_label, versions

    return Labels(hardware_label(device), versions(), git_commit())


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


def _soak(a: Asked) -> None:
    """What two servers hold after many migrations (kvmove.bench.soak); JobFailed if anything grew."""
    from kvmove.bench.soak import SoakConfig, run_soak, soak_rows, soak_transports

    chosen = () if a.transport == "auto" else (a.transport,)
    cfg = SoakConfig(migrations=a.migrations, warmup=min(20, a.migrations // 10), transports=chosen)
    runs = []
    with streams.progress() as say:
        for name in soak_transports(cfg):
            say(f"soak over {name}: {cfg.warmup} warm-up + {a.migrations} migrations between two `kvmove serve`s")
            runs.append(run_soak(cfg, name))
    rows = soak_rows(cfg, runs)
    where = None
    if a.results is not None:
        from kvmove.bench.results import append_rows

        where = append_rows(a.results, "soak", rows)
        streams.note(f"{len(rows)} soak rows appended to {where}")
    if a.as_json:
        render.json_lines(asdict(r) for r in rows)
    else:
        render.soak_table(rows, where)
    problems = [f"{r.transport}: {p}" for r in runs for p in r.problems(cfg)]
    if problems:
        raise JobFailed(f"soak not flat: {'; '.join(problems[:5])}")


SUITES: dict[Suite, Callable[[Asked], None]] = {
    Suite.plan: _plan,
    Suite.sync: _syncs,
    Suite.quick: _syncs,
    Suite.full: _full,
    Suite.gpu: _gpu_syncs,
    Suite.vllm: _vllm,
    Suite.decode_latency: _decode_latency,
    Suite.migration_gpu: _resume,
    Suite.soak: _soak,
    Suite.gpu_fp8: _gpu_fp8,
    Suite.delta: _delta,
    Suite.micro: _micro,
}
"""Each suite's runner."""

app.command("report")(streams.owns_stdout(report_cli.report))
app.command("simulate")(streams.owns_stdout(simulate_cli.simulate))
