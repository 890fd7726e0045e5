"""The micro-benchmarks' CPU twin: FP8 block quantization round-trips, rows are written and labelled."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from kvmove.bench.micro import dequantize_blocks, quantize_blocks, run


def test_fp8_block_quantization_keeps_each_tile_within_e4m3_precision() -> None:
    x = torch.randn(256, 384, dtype=torch.bfloat16) * torch.logspace(-3, 2, 384, dtype=torch.float32).bfloat16()
    q, scale = quantize_blocks(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    back = dequantize_blocks(q, scale)
    tiles = x.float().view(2, 128, 3, 128).abs().amax(dim=(1, 3))
    err = (back - x.float()).abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    assert bool((err <= tiles / 8 + 1e-6).all())  # e4m3 keeps 3 mantissa bits within each tile's scale


def test_cpu_twin_writes_labelled_rows(tmp_path) -> None:
    rows = run(tmp_path, side=256, repeats=2, gather=True)
    names = [r.name for r in rows]
    assert names[0] == "fp8 block quantize" and names[1].endswith("all_gather 4 KiB")
    df = pd.read_parquet(tmp_path / "micro.parquet")
    assert (df["kind"] == "measured").all() and len(df) == 2
    if not torch.cuda.is_available():
        assert df["hardware"].str.startswith("cpu:").all()  # the simulator takes no cost from CPU micro rows
    assert all(r.seconds > 0 for r in rows)


@pytest.mark.gpu
def test_gpu_micro_rows_set_costs(tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from kvmove.bench.results import load_results
    from kvmove.bench.sim.measure import costs_from_rows

    run(tmp_path, side=4096, repeats=3)
    book = costs_from_rows(load_results(tmp_path))
    assert book.costs["collective_s"].kind == "measured"
    # the micro-benchmark's pure-torch quantizer is not the sync's: FP8 sync rows price quantization
    assert book.costs["quantize_efficiency"].kind == "default"
