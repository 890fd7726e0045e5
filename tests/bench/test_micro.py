"""The micro-benchmarks (``kvmove bench run --suite micro``) and their CPU twin: FP8 block quantization
round-trips, rows are recorded with --results and labelled with the machine that measured them."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvmove.bench.micro import dequantize_blocks, micro_labels, micro_rows, quantize_blocks
from kvmove.bench.results import append_rows
from kvmove.cli.main import app


def test_fp8_block_quantization_keeps_each_tile_within_e4m3_precision() -> None:
    x = torch.randn(256, 384, dtype=torch.bfloat16) * torch.logspace(-3, 2, 384, dtype=torch.float32).bfloat16()
    q, scale = quantize_blocks(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    back = dequantize_blocks(q, scale)
    tiles = x.float().view(2, 128, 3, 128).abs().amax(dim=(1, 3))
    err = (back - x.float()).abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    assert bool((err <= tiles / 8 + 1e-6).all())  # e4m3 keeps 3 mantissa bits within each tile's scale


def test_the_micro_suite_records_labelled_rows_only_with_results(tmp_path) -> None:
    """The CLI suite on this machine (CPU: a 1024 x 1024 quantization and a gloo all-gather)."""
    result = CliRunner().invoke(app, ["bench", "run", "--suite", "micro", "--results", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    df = pd.read_parquet(tmp_path / "micro.parquet")
    quantize, gather = df["name"]
    assert quantize == "fp8 block quantize" and gather.endswith("all_gather 4 KiB")
    assert (df["kind"] == "measured").all() and len(df) == 2 and (df["seconds"] > 0).all()
    if not torch.cuda.is_available():
        assert df["hardware"].str.startswith("cpu:").all()  # the simulator takes no cost from CPU micro rows
    rows = micro_rows(side=256, repeats=2, gather=False)
    assert [r.name for r in rows] == ["fp8 block quantize"] and rows[0].extra["shape"] == [256, 256]


@pytest.mark.gpu
def test_gpu_micro_rows_set_costs(tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from kvmove.bench.results import load_results
    from kvmove.bench.sim.measure import costs_from_rows

    append_rows(tmp_path, "micro", micro_rows(side=4096, repeats=3), micro_labels())
    book = costs_from_rows(load_results(tmp_path))
    assert book.costs["collective_s"].kind == "measured"
    # the micro-benchmark's pure-torch quantizer is not the sync's: FP8 sync rows price quantization
    assert book.costs["quantize_efficiency"].kind == "default"
