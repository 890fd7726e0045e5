"""Published figures: each simulated as the setup it describes (training figures set only the fitted costs);
rows regenerate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from kvmove.bench.report import build_report
from kvmove.bench.sim import rows as sim_rows
from kvmove.bench.sim.costs import RowRef, default_book, replace_cost
from kvmove.bench.sim.figures import FIGURES, NOT_SIMULATED
from kvmove.bench.sim.setup import Spec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.bench.sim.validation import figure_setup, used_for_costs, validate, validate_all

BOOK = default_book()


def test_every_figure_names_a_public_source_and_a_buildable_setup() -> None:
    keys = [f.key for f in FIGURES]
    assert len(keys) == len(set(keys)) >= 25
    sources = {f.source.split()[0] for f in FIGURES}
    assert {"vLLM", "SkyRL", "MoonshotAI", "Perplexity", "LMSYS", "verl", "slime"} <= sources
    for f in FIGURES:
        assert f.url.startswith("https://") and f.value > 0 and f.strategy in SIM_STRATEGIES
        figure_setup(f)  # validates layouts (an FP8 engine's against its blocks), nodes and placement
    assert all(url.startswith("https://") for _, url, _ in NOT_SIMULATED)


def test_validation_reports_the_error_of_every_figure_good_or_bad() -> None:
    wanted = tuple(f for f in FIGURES if f.key in ("vllm-qwen3-v3", "vllm-kimi-bytes", "slime-qwen3-30b-colocated"))
    checks = validate(BOOK, wanted)
    assert [c.figure.key for c in checks] == [f.key for f in wanted]
    for c in checks:
        assert c.error_pct == pytest.approx(100 * (c.predicted / c.figure.value - 1))
        assert not c.used_for_costs
    moved = next(c for c in checks if c.figure.metric == "bytes")
    assert moved.predicted == 8_481_498_595_328  # the post's "7.9 TB" is 7,899 GiB


def test_a_cost_taken_from_a_figure_would_be_flagged() -> None:
    f = FIGURES[0]
    tainted = replace_cost(BOOK, BOOK.costs["pull_efficiency"].__class__(
        "pull_efficiency", 0.9, "fitted", (RowRef("-", "published", f.key, "", ""),), "fit to a figure"
    ))  # fmt: skip
    assert used_for_costs(f, tainted) and not used_for_costs(f, BOOK)


def test_regenerate_rewrites_every_simulated_row_and_keeps_recorded_adhoc_setups(tmp_path, monkeypatch) -> None:
    few = tuple(f for f in FIGURES if f.key in ("vllm-qwen3-v2", "vllm-qwen3-v3"))
    monkeypatch.setattr(sim_rows, "validate_all", lambda book, rows: validate_all(book, rows, few))
    tiny = Spec("qwen3-moe-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2", 2, 1, 1)
    monkeypatch.setattr(sim_rows, "user_setups", lambda: iter([("tiny", tiny.build())]))
    delta = dataclasses.replace(tiny, delta="0.02")
    monkeypatch.setattr(sim_rows, "delta_setups", lambda rows: iter([("tiny delta", delta.build())]))
    _, adhoc = sim_rows.adhoc_rows(tiny, [SIM_STRATEGIES["v3"]], BOOK)
    sim_rows.write_rows(tmp_path, adhoc, replace=False)
    path, written, _, _ = sim_rows.regenerate(tmp_path)
    df = pd.read_parquet(path)
    assert len(df) == len(written) == 2 + len(SIM_STRATEGIES) + 1 + 1 and (df["kind"] == "simulated").all()
    extras = [json.loads(e) for e in df["extra"]]
    assert [e["delta"] for e in extras].count("default=0.02") == 1
    assert sum("adhoc" in e for e in extras) == 1 and sum("published" in e for e in extras) == 2
    assert all(set(e["costs"]) == set(BOOK.costs) for e in extras)
    path2, _, _, _ = sim_rows.regenerate(tmp_path)  # idempotent: nothing accumulates
    assert len(pd.read_parquet(path2)) == len(df)
    rep = build_report(tmp_path)
    assert list(rep.validation["figure"]) == ["vllm-qwen3-v2", "vllm-qwen3-v3"]
    assert list(rep.validation["used_for_costs"]) == ["yes", "no"]  # v2 is reload_layer_s's training figure
    assert list(rep.validation["role"]) == ["training", "held-out"]


def test_every_built_in_user_setup_is_one_the_simulator_accepts() -> None:
    """``--regenerate`` builds each of them (an FP8 engine layout cutting a block is refused, for one)."""
    built = dict(sim_rows.user_setups())
    assert {"kimi-k2 fp8 quantized on trainer", "kimi-k2 fp8 quantized on engine"} <= set(built)
    assert all(s.engine.tp == 16 for name, s in built.items() if "fp8" in name)


def test_repository_simulated_rows_agree_with_a_live_validation(repo_validation) -> None:
    """results/simulated.parquet is what `kvmove bench simulate --regenerate` writes from the committed measured
    rows: every figure, with role and error, and the same prediction a live validation makes."""
    path = Path(__file__).resolve().parents[3] / "results" / "simulated.parquet"
    df = pd.read_parquet(path)
    published = {p["figure"]: p for p in (json.loads(e).get("published") for e in df["extra"]) if p}
    assert {f.key for f in FIGURES} <= set(published)
    for c in repo_validation.checks:
        p = published[c.figure.key]
        assert p["url"].startswith("https://") and p["role"] == c.role
        assert p["predicted"] == pytest.approx(c.predicted, rel=1e-9), c.figure.key
        assert p["loso_predicted"] == pytest.approx(c.loso, rel=1e-9), c.figure.key
    for o in repo_validation.own:
        assert published[o.run.key]["predicted"] == pytest.approx(o.predicted, rel=1e-9)
