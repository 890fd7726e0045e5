"""Costs from setup-matched rows only; fitted values labelled with their training figures; orders kept."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvmove.bench.results import Labels, Row, append_rows, load_results
from kvmove.bench.sim import validation as sim_validation
from kvmove.bench.sim.costs import default_book
from kvmove.bench.sim.figures import FIGURES, ORDERS
from kvmove.bench.sim.fitting import check_training, fit, informing, training_keys
from kvmove.bench.sim.measure import costs_from_rows
from kvmove.bench.sim.models import sim_model
from kvmove.bench.sim.validation import orders, validate_all
from kvmove.cli.main import app
from kvmove.errors import KvmoveError
from kvmove.models import model_totals


def _v1(request: float, trainer: str, devices: tuple[list[str], list[str]], placement: str) -> Row:
    return Row(
        kind="measured",
        suite="gpu",
        name="sync v1",
        model="qwen3-moe-tiny",
        trainer=trainer,
        engine="tp=1,dp=1,ep=1,pp=1 x1",
        strategy="v1",
        transport="cuda-ipc",
        bytes=model_totals(sim_model("qwen3-moe-tiny")).total_bytes,
        seconds=1.0,
        phases={"request": request, "gather": 0.1, "pack": 0.1, "load": 0.1, "transfer": 0.1},
        extra={"sync": 2, "verified": True, "direct": False, "placement": placement,
               "trainer_devices": devices[0], "engine_devices": devices[1]},
    )  # fmt: skip


def test_a_colocated_gloo_row_never_sets_a_disaggregated_gpu_cost(tmp_path) -> None:
    """Newer colocated one-GPU rows (trainer ranks sharing the GPU gather through host gloo) do not replace the
    older two-GPU rows' per-request cost for full-scale targets; they do set it for one-GPU targets."""
    disagg = _v1(0.01, "tp=1,pp=1,ep=1,etp=1,dp=1", (["cuda:0"], ["cuda:1"]), "disaggregated")
    gloo = _v1(9.0, "tp=2,pp=1,ep=1,etp=1,dp=1", (["cuda:0", "cuda:0"], ["cuda:0"]), "colocated")
    single = _v1(5.0, "tp=1,pp=1,ep=1,etp=1,dp=1", (["cuda:0"], ["cuda:0"]), "colocated")
    append_rows(tmp_path, "gpu", [disagg], Labels("gpu:H200 x2", {}, "old"))
    append_rows(tmp_path, "gpu", [gloo, single], Labels("gpu:H200 x1", {}, "new"))
    rows = load_results(tmp_path)
    cluster = costs_from_rows(rows).costs["request_s"]
    assert [r.commit for r in cluster.rows] == ["old"] and "disaggregated x2" in cluster.rows[0].setup
    assert "disaggregated gpu" in cluster.note
    one = costs_from_rows(rows, "one-gpu").costs["request_s"]
    assert [r.commit for r in one.rows] == ["new"] and one.value > cluster.value  # not the gloo row: gather none
    assert all("tp=1,pp=1" in r.setup for r in one.rows)
    with pytest.raises(KvmoveError, match="unknown cost target"):
        costs_from_rows(rows, "moon")


def test_training_set_takes_at_most_one_figure_per_source() -> None:
    check_training(FIGURES)
    by_key = {f.key: f for f in FIGURES}
    sources = [by_key[k].source for k in training_keys()]
    assert len(sources) == len(set(sources)) and len(training_keys()) < len(FIGURES) // 4


def test_fitted_values_are_labelled_with_their_training_figures() -> None:
    wanted = tuple(f for f in FIGURES if f.key == "vllm-qwen3-v2")
    result = fit(default_book(), wanted)
    cost = result.book.costs["reload_layer_s"]
    assert cost.kind == "fitted" and [r.name for r in cost.rows] == ["vllm-qwen3-v2"]
    assert all(r.suite == "published" for r in cost.rows) and "training set" in cost.note
    assert result.values["reload_layer_s"].figures == informing("reload_layer_s") == ("vllm-qwen3-v2",)
    assert [r.name for r in result.book.costs["nic_efficiency"].rows] == ["vllm-qwen3-v2"]  # it informs both
    assert result.book.costs["loader_tensor_s"].kind == "default"  # its training figure is not in this set
    (check,) = sim_validation.validate(result.book, wanted)
    assert check.role == "training" and abs(check.error_pct) < 5


def test_published_orders_are_kept(repo_validation) -> None:
    kept = orders(repo_validation.checks)
    assert len(kept) == len(ORDERS)
    assert all(ok for _, _, ok in kept), [k for k in kept if not k[2]]


def test_no_prediction_beats_its_speed_of_light(repo_validation) -> None:
    for c in repo_validation.checks:
        assert c.prediction.seconds >= c.prediction.speed_of_light_seconds, c.figure.key
    assert repo_validation.fit is not None
    for name, v in repo_validation.fit.values.items():
        assert v.figures and repo_validation.fit.book.costs[name].kind == "fitted"


def test_every_published_time_is_possible_in_the_setup_it_is_simulated_as(repo_validation) -> None:
    """A figure faster than its declared setup's speed of light (that strategy's transfers at line rate, all at
    once) says the setup is wrong, not that the system beat physics: the declared layouts must allow each figure."""
    for c in repo_validation.checks:
        if c.figure.metric == "seconds":
            assert c.figure.value >= c.prediction.speed_of_light_seconds, (c.figure.key, c.prediction.binding_link)


def test_validate_json_is_json_lines(monkeypatch, tmp_path) -> None:
    few = tuple(f for f in FIGURES if f.key in ("vllm-qwen3-v2", "vllm-qwen3-v3"))
    monkeypatch.setattr(sim_validation, "validate_all", lambda book, rows: validate_all(book, rows, few))
    out = CliRunner().invoke(app, ["bench", "simulate", "--validate", "--json", "--results", str(tmp_path)])
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    figures = [x for x in lines if x["kind"] == "figure"]
    assert [(x["figure"], x["role"]) for x in figures] == [("vllm-qwen3-v2", "training"), ("vllm-qwen3-v3", "held-out")]
    assert {x["kind"] for x in lines} == {"figure", "fitted", "order", "summary"}
    assert all(x["kept"] is True for x in lines if x["kind"] == "order")  # JSON booleans, not strings
    assert lines[-1]["kind"] == "summary" and "held_out_median_abs_error_pct" in lines[-1]


def test_quantization_is_priced_from_the_syncs_own_fp8_rows_not_the_micro_benchmark(tmp_path) -> None:
    """The micro-benchmark's pure-torch quantizer sets no cost; an FP8 sync's pack phase (the batched quantize
    programs) does, for any placement; a BF16 row never does."""
    micro = Row(kind="measured", suite="micro", name="fp8 block quantize", bytes=3, seconds=1.0, gbps=100.0)
    append_rows(tmp_path, "micro", [micro], Labels("gpu:H200 x2", {}, "m"))
    assert costs_from_rows(load_results(tmp_path)).costs["quantize_efficiency"].kind == "default"
    fp8 = _v1(0.0, "tp=1,pp=1,ep=1,etp=1,dp=1", (["cuda:0"], ["cuda:0"]), "colocated")
    fp8 = Row(**{**fp8.__dict__, "name": "fp8 sync v3", "strategy": "v3", "model": "qwen3-moe-fp8-tiny",
                 "bytes": model_totals(sim_model("qwen3-moe-fp8-tiny")).total_bytes,
                 "phases": {"pack": 0.01, "gather": 0.0, "load": 0.01, "transfer": 0.01, "request": 0.0},
                 "extra": {**fp8.extra, "engine_dtype": "fp8"}})  # fmt: skip
    append_rows(tmp_path, "gpu", [fp8], Labels("gpu:H200 x1", {}, "q"))
    rows = load_results(tmp_path)
    for target in ("cluster", "one-gpu"):
        cost = costs_from_rows(rows, target).costs["quantize_efficiency"]
        assert cost.kind == "derived" and [r.commit for r in cost.rows] == ["q"], target
        assert 0 < cost.value <= 1
    assert costs_from_rows(rows).costs["ipc_efficiency"].kind == "default"  # an FP8 row sets no BF16 cost
