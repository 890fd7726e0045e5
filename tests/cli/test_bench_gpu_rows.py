"""`kvmove bench run --suite gpu|gpu-fp8 --results DIR`: rows recorded as they land are said to be recorded."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
from result_rows import sync_rows

import kvmove.bench.results as results
from kvmove.cli import bench


def test_gpu_rows_recorded_as_they_land_are_never_called_not_recorded(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(results, "hardware_label", lambda device="cpu": "gpu:Test x1")
    monkeypatch.setattr(results, "git_commit", lambda: "0123456789ab")
    rows = sync_rows({"v3": 1.0}, {"engine_dtype": "fp8"})

    def run_suite(suite, record, say):  # as kvmove.bench.gpu_fp8.gpu_fp8_suite: record each batch, return all
        record(rows)
        return rows

    bench._gpu_rows(run_suite, SimpleNamespace(devices=("cuda:0",)), tmp_path, False)
    out = capsys.readouterr()
    assert f"1 gpu rows appended to {tmp_path / 'gpu.parquet'}" in out.err
    assert "not recorded" not in out.err + out.out
    assert len(pd.read_parquet(tmp_path / "gpu.parquet")) == 1
