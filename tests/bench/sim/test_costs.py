"""Costs: traceable to the rows they come from, named defaults flagged, efficiencies above 1 refused."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvmove.bench.results import Labels, Row, append_rows, load_results
from kvmove.bench.sim.costs import SPECS, Cost, CostBook, default_book, load_cost_file, parse_cost_flags
from kvmove.bench.sim.hardware import GPUS, Cluster, gpu_of_hardware
from kvmove.bench.sim.measure import costs_from_rows
from kvmove.errors import KvmoveError

REPO_RESULTS = Path(__file__).resolve().parents[3] / "results"


def _ceilings(commit: str, copy_gbps: float, p2p_gbps: float) -> list[Row]:
    return [
        Row(kind="measured", suite="gpu", name="ceiling device copy (read+write)", bytes=2, seconds=1, gbps=copy_gbps),
        Row(kind="measured", suite="gpu", name="ceiling p2p copy cuda:0->cuda:1", bytes=1, seconds=1, gbps=p2p_gbps),
        Row(kind="measured", suite="gpu", name="ceiling pinned H2D", bytes=1, seconds=1, gbps=50.0),
    ]


def test_efficiency_above_one_is_refused_wherever_it_comes_from(tmp_path) -> None:
    with pytest.raises(
        KvmoveError, match=r"refused: an efficiency is a fraction of a line rate in .0, 1.*speed of light"
    ):
        Cost("pull_efficiency", 1.2, "user")
    with pytest.raises(KvmoveError, match=r"pull_efficiency = 1\.5 refused"):
        parse_cost_flags(["pull_efficiency=1.5"])
    with pytest.raises(KvmoveError, match="refused"):
        default_book().with_values({"copy_efficiency": 2.0}, "test")
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"nccl_efficiency": {"value": 1.01}}))
    with pytest.raises(KvmoveError, match=r"nccl_efficiency = 1\.01 refused"):
        load_cost_file(path)
    with pytest.raises(KvmoveError, match="must be a finite number >= 0"):
        parse_cost_flags(["request_s=-1"])


def test_bad_cost_input_is_one_clear_error(tmp_path) -> None:
    with pytest.raises(KvmoveError, match="unknown cost 'speed'"):
        parse_cost_flags(["speed=1"])
    with pytest.raises(KvmoveError, match="is not NAME=NUMBER"):
        parse_cost_flags(["request_s"])
    with pytest.raises(KvmoveError, match="is not NAME=NUMBER"):
        parse_cost_flags(["request_s=fast"])
    with pytest.raises(KvmoveError, match="no such costs file"):
        load_cost_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(KvmoveError, match="must hold a JSON object"):
        load_cost_file(tmp_path / "bad.json")
    (tmp_path / "str.json").write_text('{"request_s": "1"}')
    with pytest.raises(KvmoveError, match="request_s must be a number"):
        load_cost_file(tmp_path / "str.json")


def test_without_rows_every_cost_is_a_flagged_default() -> None:
    book = costs_from_rows(None)
    assert set(book.defaults()) == set(SPECS)
    assert all("no measurement of ours yet" in c.note for c in book.costs.values())
    assert book["push_efficiency"] == book["pull_efficiency"]  # an inheriting default follows its source
    assert book.with_values({"pull_efficiency": 0.5}, "t")["push_efficiency"] == 0.5
    assert CostBook.from_json(book.to_json()).to_json() == book.to_json()


def test_costs_come_from_the_newest_commit_and_name_their_rows(tmp_path) -> None:
    h200 = GPUS["h200"]
    append_rows(tmp_path, "gpu", _ceilings("aaa", 4000.0, 380.0), Labels("gpu:H200 x2", {}, "aaa"))
    append_rows(tmp_path, "gpu", _ceilings("bbb", 4200.0, 390.0), Labels("gpu:H200 x2", {}, "bbb"))
    append_rows(tmp_path, "gpu", _ceilings("ccc", 9.0, 9.0), Labels("cpu:some cpu x2", {}, "ccc"))  # not a GPU
    book = costs_from_rows(load_results(tmp_path))
    copy = book.costs["copy_efficiency"]
    assert copy.kind == "measured" and copy.value == pytest.approx(4200.0 / h200.hbm_gbps)
    assert [r.commit for r in copy.rows] == ["bbb"] and copy.rows[0].suite == "gpu"
    assert copy.rows[0].name.startswith("ceiling device copy") and copy.rows[0].hardware == "gpu:H200 x2"
    assert book.costs["p2p_efficiency"].value == pytest.approx(390.0 / h200.nvlink_gbps)
    assert book.costs["h2d_efficiency"].value == pytest.approx(50.0 / h200.pcie_gbps)
    assert "pull_efficiency" in book.defaults() and "copy_efficiency" not in book.defaults()


def test_every_measured_cost_of_the_repository_rows_is_traceable() -> None:
    """Each cost names rows that exist in results/ (commit, suite, name); the rest are flagged defaults."""
    rows = load_results(REPO_RESULTS)
    rows = rows[rows["kind"] == "measured"]
    book = costs_from_rows(rows)
    present = {(str(c)[:8], s, n) for c, s, n in zip(rows["git_commit"], rows["suite"], rows["name"], strict=True)}
    measured = [c for c in book.costs.values() if c.kind in ("measured", "derived")]
    assert {"copy_efficiency", "pull_efficiency", "request_s", "pack_efficiency", "broadcast_op_s"} <= {
        c.name for c in measured
    }
    for c in measured:
        assert c.rows, c.name
        for ref in c.rows:
            assert (ref.commit[:8], ref.suite, ref.name) in present, (c.name, ref)
        assert 0 < c.value <= 1 if c.unit == "fraction" else c.value >= 0
    assert not any(r.suite in ("published", "simulated") for c in book.costs.values() for r in c.rows)


def test_new_gpu_rows_of_another_layout_are_picked_up(tmp_path) -> None:
    """A sync row of a layout the GPU suite never ran still yields costs: counts come from its own traffic."""
    row = Row(
        kind="measured",
        suite="gpu",
        name="sync v1",
        model="qwen3-moe-tiny",
        trainer="tp=2,pp=1,ep=2,etp=1,dp=1",
        engine="tp=2,dp=1,ep=1,pp=1 x1",
        strategy="v1",
        transport="nixl",
        bytes=0,
        seconds=1.0,
        phases={"request": 0.5, "gather": 0.1, "pack": 0.1, "load": 0.1, "transfer": 0.1},
        extra={"sync": 2, "verified": True, "direct": False},
    )
    from kvmove.bench.sim.models import sim_model
    from kvmove.models import model_totals

    row = Row(**{**row.__dict__, "bytes": model_totals(sim_model("qwen3-moe-tiny")).total_bytes})
    append_rows(tmp_path, "gpu", [row], Labels("gpu:H100 x2", {}, "ddd"))
    book = costs_from_rows(load_results(tmp_path))
    request = book.costs["request_s"]
    assert request.kind == "derived" and request.rows[0].commit == "ddd" and request.value > 0
    assert "tp=2,pp=1" in request.rows[0].setup
    # the request phase spans the trainer's gather and pack (priced as such): only the rest is per request
    pulls = book.costs["request_s"].value
    append_rows(tmp_path, "gpu", [Row(**{**row.__dict__, "phases": {**row.phases, "request": 0.2}})],
                Labels("gpu:H100 x2", {}, "eee"))  # fmt: skip
    assert costs_from_rows(load_results(tmp_path)).costs["request_s"].value == 0.0 < pulls


def test_cluster_presets_and_flags() -> None:
    c = Cluster.parse("gpu=h200,nic=cx7-400")
    assert c.gpu_nic_rate == 50e9 and c.node_nic_rate == 400e9 and c.nvlink_rate == 450e9
    assert Cluster.parse(c.spec()) == c
    slow = Cluster.parse("gpu=h100,nic_gbps=200,nics_per_node=4")
    assert slow.gpu_nic_rate == 12.5e9 and "user flags" in slow.nic.source
    legacy = Cluster.parse("gpus_per_node=8,nic_gbps=400,nvlink_gbps=450")
    assert legacy.gpu_nic_rate == 50e9
    for gpu in ("h100", "h200", "h20", "b200"):
        assert GPUS[gpu].source.startswith("https://")
    assert gpu_of_hardware("gpu:H200 x2") is GPUS["h200"] and gpu_of_hardware("cpu:AMD EPYC x2") is None
    for bad, msg in (
        ("gpu=a100", "unknown gpu 'a100'"),
        ("nic=ib", "unknown nic 'ib'"),
        ("speed=1", "is not one of"),
        ("nic_gbps=fast", "must be a number"),
        ("nvlink_gbps=0", "must be positive"),
        ("gpus_per_node=2.5", "must be a whole number"),
    ):
        with pytest.raises(KvmoveError, match=msg):
            Cluster.parse(bad)


def test_costs_table_names_kind_and_rows() -> None:
    from kvmove.bench.sim.tables import costs_frame

    df = costs_frame(costs_from_rows(pd.DataFrame()))
    assert list(df["cost"]) == list(SPECS) and set(df["kind"]) == {"default"}
