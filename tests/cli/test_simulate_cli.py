"""`kvmove bench simulate` and `kvmove sync-weights --simulate`: JSON keys, rows, clear errors."""

from __future__ import annotations

import json

import pandas as pd
from typer.testing import CliRunner

from kvmove.cli.main import app

TINY = ["--model", "qwen3-moe-tiny", "--trainer", "tp=2,pp=2,ep=2", "--engine", "tp=2,ep=2", "--replicas", "2"]
NODES = ["--trainer-nodes", "1", "--engine-nodes", "1"]


def _run(args: list[str]) -> object:
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_simulate_json_rows_and_recording(tmp_path) -> None:
    args = ["bench", "simulate", *TINY, *NODES, "--strategy", "v1,v3", "--json", "--results", str(tmp_path)]
    out = _run([*args, "--record", "--cost", "request_s=1e-4"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["strategy"] for x in lines] == ["v1", "v3"]
    for x in lines:
        assert x["simulated"] is True and x["seconds"] >= x["speed_of_light_seconds"] > 0
        assert {"bytes_total", "receiver_bound_seconds", "phases", "binding_link", "default_costs"} <= set(x)
        assert "request_s" not in x["default_costs"] and "pull_efficiency" in x["default_costs"]
    df = pd.read_parquet(tmp_path / "simulated.parquet")
    assert len(df) == 2 and all("adhoc" in json.loads(e) for e in df["extra"])


def test_simulate_table_validate_and_costs_render(tmp_path) -> None:
    out = _run(["bench", "simulate", *TINY, *NODES, "--strategy", "v2", "--results", str(tmp_path), "--show-costs"])
    assert out.exit_code == 0, out.output
    assert "simulated:" in out.stdout and "named defaults" in out.stdout and "pull_efficiency" in out.stdout


def test_bad_simulate_input_exits_2_with_one_line(tmp_path) -> None:
    for extra, message in (
        (["--cost", "pull_efficiency=1.3"], "refused"),
        (["--cost", "nope=1"], "unknown cost 'nope'"),
        (["--strategy", "v9"], "unknown strategy 'v9'"),
        (["--cluster", "gpu=tpu"], "unknown gpu 'tpu'"),
        (["--fanout", "tree", "--replicas", "1"], "needs --replicas >= 2"),
        (["--dtype", "int4"], "dtype 'int4' is not one of"),
        (["--costs", str(tmp_path / "none.json")], "no such costs file"),
    ):
        args = ["bench", "simulate", "--model", "qwen3-moe-tiny", "--trainer", "tp=2,pp=2,ep=2", "--engine", "tp=2"]
        result = CliRunner().invoke(app, [*args, *NODES, *extra, "--results", str(tmp_path)])
        assert result.exit_code != 0 and message in str(result.exception) + result.output, (extra, result.output)


def test_sync_weights_simulate_keeps_its_json_contract(tmp_path) -> None:
    args = ["sync-weights", "--simulate", *TINY, *NODES, "--strategy", "v1,v2,v3,broadcast", "--results", str(tmp_path)]
    out = _run([*args, "--cluster", "gpus_per_node=8,nic_gbps=400,nvlink_gbps=450"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [x["strategy"] for x in lines] == ["v1", "v2", "v3", "broadcast"]
    for x in lines:
        assert {"strategy", "seconds", "bytes_total", "speed_of_light_seconds", "simulated"} <= set(x)
    assert not (tmp_path / "simulated.parquet").exists()


def test_sync_weights_simulate_fp8_engine_moves_fewer_bytes(tmp_path) -> None:
    args = ["sync-weights", "--simulate", "--model", "qwen3-235b-a22b", "--trainer", "tp=4,pp=2,ep=8"]
    args += ["--engine", "dp=16,ep=16", "--trainer-nodes", "2", "--engine-nodes", "2", "--strategy", "v3"]
    rows = {}
    for dtype in ("bf16", "fp8"):
        out = _run([*args, "--engine-dtype", dtype, "--results", str(tmp_path)])
        assert out.exit_code == 0, out.output
        rows[dtype] = json.loads(out.stdout)
    assert "fp8 (quantized on trainer)" in rows["fp8"]["setup"] and "bf16" in rows["bf16"]["setup"]
    assert rows["fp8"]["bytes_total"] < 0.6 * rows["bf16"]["bytes_total"]
