"""`kvmove bench`: run benchmark suites into results/ (reports come from `kvmove bench report`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvmove.bench.results import append_rows
from kvmove.cli import render
from kvmove.cli import report as report_cli
from kvmove.cli import simulate as simulate_cli
from kvmove.errors import KvmoveError

app = typer.Typer(no_args_is_help=True, help="Benchmarks: measured and simulated rows in results/.")

ResultsOpt = Annotated[Path, typer.Option("--results", help="Directory of result parquet files.")]

SUITES = ("plan", "sync", "quick", "full", "gpu", "vllm", "decode-latency", "migration-gpu")


@app.command("run")
def run(
    suite: Annotated[str, typer.Option("--suite", help=f"One of {', '.join(SUITES)}.")] = "quick",
    results: ResultsOpt = Path("results"),
    transport: Annotated[str, typer.Option("--transport", help="Transport of the sync suite.")] = "auto",
    syncs: Annotated[int, typer.Option("--syncs", min=1, help="Syncs per strategy in the sync suite.")] = 3,
) -> None:
    """Run a benchmark suite and append its rows to results/.

    Example: kvmove bench run --suite plan
    """
    if suite not in SUITES:
        raise KvmoveError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    if suite == "gpu":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            raise KvmoveError("the gpu suite needs two CUDA GPUs (see kvmove/bench/gpu.py for the exact command)")
        from kvmove.bench.gpu import main as gpu_main

        gpu_main(["--out", str(results)])
        return
    if suite in ("plan", "full"):
        from kvmove.bench.plans import plan_rows

        rows = plan_rows()
        render.bench_rows(rows, append_rows(results, "plan", rows))
    if suite in ("sync", "quick", "full"):
        from kvmove.bench.syncs import summarize, sync_suite

        rows = sync_suite(transport=transport, syncs=syncs)
        append_rows(results, "transport", [r for r in rows if r.suite == "transport"])
        render.bench_rows(rows, append_rows(results, "sync", [r for r in rows if r.suite == "sync"]))
        render.summary(summarize(rows))
    if suite == "migration-gpu":
        import torch

        if not torch.cuda.is_available():
            raise KvmoveError("the migration-gpu suite needs a CUDA GPU (see kvmove/bench/resume.py for the command)")
        from kvmove.bench.resume import main as resume_main  # NOTE: one GPU, plain torch

        resume_main(["--out", str(results)])
        return
    if suite == "decode-latency":
        from kvmove.bench.decode_latency import DecodeLatencyConfig, decode_latency

        rows = [decode_latency(DecodeLatencyConfig(transport=transport), say=typer.echo)]
        render.bench_rows(rows, append_rows(results, "decode_latency", rows))
    if suite == "vllm":
        from kvmove.bench.syncs import vllm_suite

        rows = vllm_suite(transport=transport, syncs=syncs)
        render.bench_rows(rows, append_rows(results, "vllm", rows))


app.command("report")(report_cli.report)
app.command("simulate")(simulate_cli.simulate)
