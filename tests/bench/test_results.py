from __future__ import annotations

import json

import pandas as pd
import pytest

from kvmove.bench.results import COLUMNS, Labels, Row, append_rows, json_dict, load_results
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


def test_rows_name_the_loopback_shaping_and_ucx_selection_they_ran_under(tmp_path, monkeypatch) -> None:
    """A fake ``tc`` stands for a host whose loopback carries an htb class: the class and qdisc lines come back, the
    default qdisc does not; without ``tc`` or any shaping nothing is added."""
    from kvmove.bench.results import link_conditions

    tc = tmp_path / "tc"
    tc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = qdisc ]; then echo "qdisc htb 1: root refcnt 2 r2q 10 default 0x99"; fi\n'
        'if [ "$1" = class ]; then echo "class htb 1:2 root prio 0 rate 1Gbit ceil 1Gbit burst 256Kb"; fi\n'
    )
    tc.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.delenv("UCX_TCP_PORT_RANGE", raising=False)
    got = link_conditions()
    assert got["ucx_tls"] == "tcp" and "ucx_tcp_port_range" not in got
    assert got["loopback_shaping"] == (
        "qdisc htb 1: root refcnt 2 r2q 10 default 0x99; class htb 1:2 root prio 0 rate 1Gbit ceil 1Gbit burst 256Kb"
    )
    tc.write_text('#!/bin/sh\nif [ "$1" = qdisc ]; then echo "qdisc noqueue 0: root refcnt 2"; fi\n')
    assert "loopback_shaping" not in link_conditions()
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("UCX_TLS")
    assert link_conditions() == {}


def test_a_rows_phases_and_extra_read_back_as_dicts_whatever_was_stored(tmp_path) -> None:
    """What a row stored (JSON text) and what a caller built (a dict) read the same; anything else reads as {}."""
    append_rows(tmp_path, "sync", [Row(kind="measured", suite="sync", name="x", extra={"sync": 2, "raw_gbps": 3.5})])
    (stored,) = load_results(tmp_path)["extra"]
    assert json_dict(stored) == json_dict({"sync": 2, "raw_gbps": 3.5}) == {"sync": 2, "raw_gbps": 3.5}
    assert [json_dict(v) for v in ("[1, 2]", "not json", None, float("nan"))] == [{}, {}, {}, {}]
