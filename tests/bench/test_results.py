from __future__ import annotations

import json

import pandas as pd
import pytest

from kvmove.bench.results import COLUMNS, Labels, Row, append_rows, load_results
from kvmove.errors import KvmoveError

LABELS = Labels("cpu:test x2", {"kvmove": "0"}, "abc")


def test_append_and_load_roundtrip(tmp_path) -> None:
    row = Row(kind="measured", suite="plan", name="x", bytes=10, seconds=0.5, phases={"a": 0.1}, extra={"k": 1})
    append_rows(tmp_path, "plan", [row], LABELS)
    append_rows(tmp_path, "plan", [Row(kind="simulated", suite="plan", name="y")], LABELS)
    df = load_results(tmp_path)
    assert len(df) == 2 and set(COLUMNS) <= set(df.columns)
    assert json.loads(df.iloc[0]["phases"]) == {"a": 0.1} and df.iloc[0]["kind"] == "measured"


def test_kind_must_be_labelled(tmp_path) -> None:
    with pytest.raises(KvmoveError, match="measured or simulated"):
        append_rows(tmp_path, "plan", [Row(kind="guessed", suite="plan", name="x")], LABELS)


def test_unknown_columns_tolerated_and_corrupt_files_named(tmp_path) -> None:
    pd.DataFrame([{"kind": "measured", "name": "z", "future_column": 3}]).to_parquet(tmp_path / "new.parquet")
    df = load_results(tmp_path)
    assert "future_column" in df.columns and set(COLUMNS) <= set(df.columns)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(KvmoveError, match=r"bad\.parquet is unreadable"):
        load_results(tmp_path)


def test_empty_results_dir(tmp_path) -> None:
    with pytest.raises(KvmoveError, match="no results"):
        load_results(tmp_path)


def test_rows_from_a_dirty_tree_are_refused_and_nothing_is_written(tmp_path) -> None:
    row = Row(kind="measured", suite="plan", name="x", seconds=0.5)
    append_rows(tmp_path, "plan", [row], LABELS)
    before = (tmp_path / "plan.parquet").read_bytes()
    dirty = Labels("cpu:test x2", {"kvmove": "0"}, "0123456789ab-dirty")
    with pytest.raises(KvmoveError, match=r"refusing to record rows from a dirty tree \(0123456789ab-dirty"):
        append_rows(tmp_path, "plan", [row], dirty)
    with pytest.raises(KvmoveError, match="dirty tree"):
        append_rows(tmp_path, "sync", [row], dirty)
    assert (tmp_path / "plan.parquet").read_bytes() == before and not (tmp_path / "sync.parquet").exists()
