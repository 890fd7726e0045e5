"""``kvmove check``: checks of this machine's kernels, each bit-exact against a reference and timed against the same
run's device-copy rate. They need no Ray and no pytest, so they run as they are on a bare GPU machine."""

from __future__ import annotations

import typer

from kvmove.cli import render
from kvmove.cli.options import JsonOpt
from kvmove.errors import JobFailed, MissingDependencyError

app = typer.Typer(no_args_is_help=True, help="Checks of this machine's kernels: bit-exact results and their speed.")


@app.command("quant")
def quant(as_json: JsonOpt = False) -> None:
    """The block-FP8 quantizer on every backend here (CPU torch, CUDA torch, each Triton variant) against the CPU
    bits on hard cases (ties, subnormals, ±448, zeros), the exhaustive proofs of the fast variant's shortcuts on a
    GPU, and its GB/s as a fraction of the same run's device-copy rate. Exit 1 if any bit differs.

    Example: kvmove check quant --json
    """
    from kvmove.quant.check import report

    result = report()
    if as_json:
        render.json_lines([{**result._asdict(), "ok": result.ok}])
    else:
        render.line(f"{result.device}: backends {', '.join(result.backends)}")
        for c in result.checks:
            render.line(f"{c['case']} {c['backend']}/{c['device']}: {'equal' if c['equal'] else 'DIFFERS'}")
        for t in result.throughput:
            render.line(" ".join(f"{k}={render.num(v)}" for k, v in t.items()))
    if not result.ok:
        raise JobFailed("the quantizer's bits differ between backends (or a proof found a mismatch)")


@app.command("copy")
def copy(as_json: JsonOpt = False) -> None:
    """The 2-D copy executors (the driver's copy engine, the Triton kernel, the split cuda-ipc makes) on a
    pp=2 -> tp=2-shaped plan of Qwen3-235B-A22B, on one GPU and across two if there are: GB/s and equal bits,
    against a contiguous copy of the same bytes. Needs a CUDA GPU. Exit 1 if any copy differs.

    Example: kvmove check copy
    """
    import torch

    from kvmove.transport.copy_check import check, plan_summary

    if not torch.cuda.is_available():
        raise MissingDependencyError("kvmove check copy needs a CUDA GPU")
    pairs = [("cuda:0", "cuda:0")] + ([("cuda:1", "cuda:0")] if torch.cuda.device_count() > 1 else [])
    rows = [r for s, d in pairs for r in check(s, d)]
    if as_json:
        render.json_lines({**r._asdict(), "gbps": r.gbps} for r in rows)
    else:
        render.line(f"pp=2 -> tp=2 shaped plan: {plan_summary()}")
        for r in rows:
            render.line(f"{r.where} {r.executor}: {r.seconds * 1e3:.2f} ms, {r.gbps:.1f} GB/s, equal={r.equal}")
    if not all(r.equal for r in rows):
        raise JobFailed("a copy executor wrote other bytes than the plan's")
