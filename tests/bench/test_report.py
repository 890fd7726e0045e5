"""The report: tolerant loading, runs per (commit, setup), faults apart, filters, and real PNG plots."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from result_rows import migration_rows, sync_rows, write

from kvmove.bench.report import Filters, build_report
from kvmove.bench.results import Row
from kvmove.bench.runs import latest_complete, short_commit
from kvmove.bench.sim.validation import Check
from kvmove.errors import KvmoveError


@pytest.fixture(scope="module")
def simulated_rows() -> list[Row]:
    """Two figures' rows as the simulator writes them (default costs: no measured rows here)."""
    from kvmove.bench.sim.costs import default_book
    from kvmove.bench.sim.figures import FIGURES
    from kvmove.bench.sim.rows import prediction_row
    from kvmove.bench.sim.validation import figure_setup, validate

    book = default_book()
    wanted = tuple(f for f in FIGURES if f.key in ("vllm-qwen3-v2", "vllm-qwen3-v3"))
    return [prediction_row(c.prediction, figure_setup(c.figure), book, c.figure.key, c) for c in validate(book, wanted)]


def test_missing_and_empty_results_dirs(tmp_path) -> None:
    with pytest.raises(KvmoveError, match="does not exist"):
        build_report(tmp_path / "nope")
    with pytest.raises(KvmoveError, match="no results"):
        build_report(tmp_path)


def test_only_corrupt_or_empty_files_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    pd.DataFrame({"kind": pd.Series([], dtype=str)}).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(KvmoveError, match=r"no readable rows .*bad\.parquet is unreadable.*empty\.parquet has no rows"):
        build_report(tmp_path)


def test_corrupt_file_skipped_with_note_and_unknown_columns_kept(tmp_path) -> None:
    write(tmp_path, "sync", sync_rows())
    (tmp_path / "bad.parquet").write_bytes(b"\x00garbage")
    pd.DataFrame(
        [{"kind": "measured", "suite": "sync", "strategy": "v2", "seconds": 2.0, "from_future": 1}]
    ).to_parquet(tmp_path / "newer.parquet")
    rep = build_report(tmp_path)
    assert any("bad.parquet is unreadable" in n for n in rep.notes)
    assert any("from_future" in n for n in rep.notes) and "from_future" in rep.rows.columns
    row = rep.sync[rep.sync["model"] == "qwen3-moe-tiny"].iloc[0]
    assert row["v3_speedup_vs_v1"] == pytest.approx(4.0) and row["v3_speedup_vs_broadcast"] == pytest.approx(8.0)
    assert row["v3_pct_of_link"] == pytest.approx(100 / 3)


def test_one_row_per_commit_and_setup_with_strategies_side_by_side(tmp_path) -> None:
    write(tmp_path, "sync", sync_rows() + sync_rows({"v1": 6.0, "v3": 3.0, "broadcast": 8.0}), "c0ffee001234")
    rep = build_report(tmp_path)
    assert len(rep.sync) == 1
    row = rep.sync.iloc[0]
    assert (row["commit"], row["transport"], row["pulls"], row["syncs"]) == ("c0ffee00", "nixl", "direct", 2)
    assert row["v3_seconds"] == 2.0 and (row["v3_seconds_min"], row["v3_seconds_max"]) == (1.0, 3.0)
    assert row["broadcast_transport"] == "gloo-broadcast" and row["strategies"] == "v1,v3,broadcast"


def test_bf16_and_fp8_engines_of_one_layout_are_two_setups(tmp_path) -> None:
    bf16 = sync_rows({"v3": 1.0}, {"engine_dtype": "bf16"})
    fp8 = sync_rows({"v3": 4.0}, {"engine_dtype": "fp8"}) + sync_rows({"v3": 5.0}, {"engine_dtype": "fp8"})
    older = sync_rows({"v3": 1.0})  # rows written before FP8 engines existed: BF16
    write(tmp_path, "gpu", bf16 + fp8 + older, "c0ffee001234")
    rep = build_report(tmp_path)
    assert len(rep.sync) == 2
    by_dtype = rep.sync.set_index("engine_dtype")
    assert by_dtype.loc["bf16", "v3_seconds"] == 1.0 and by_dtype.loc["bf16", "syncs"] == 2
    assert by_dtype.loc["fp8", "v3_seconds"] == 4.5 and by_dtype.loc["fp8", "syncs"] == 2


def test_faulty_syncs_are_reported_apart_never_in_medians(tmp_path) -> None:
    clean = sync_rows()
    dead = sync_rows({"v3": 0.5}, {"dead_replicas": [1], "live_engines": 2})
    missing = sync_rows({"v3": 0.4}, {"live_engines": 2})
    wrong = sync_rows({"v3": 0.3}, {"verified": False})
    write(tmp_path, "sync", clean + dead + missing + wrong)
    rep = build_report(tmp_path)
    assert rep.sync.iloc[0]["v3_seconds"] == 1.0 and rep.sync.iloc[0]["syncs"] == 1
    assert list(rep.faults["fault"]) == ["replica 1 dead", "2/4 engine ranks live", "did not verify"]
    assert list(rep.faults["seconds"]) == [0.5, 0.4, 0.3]


def test_dirty_commits_stay_apart_from_clean_ones(tmp_path) -> None:
    write(tmp_path, "sync", sync_rows(), "0123456789ab")
    write(tmp_path, "sync", sync_rows({"v1": 9.0, "v3": 9.0}), "0123456789ab")
    df = pd.read_parquet(tmp_path / "sync.parquet")  # rows recorded before dirty trees were refused
    df.loc[df.index[3:], "git_commit"] = "0123456789ab-dirty"
    df.to_parquet(tmp_path / "sync.parquet", index=False)
    rep = build_report(tmp_path)
    assert sorted(rep.sync["commit"]) == ["01234567", "01234567-dirty"]
    assert any("2 rows of dirty trees (0123456789ab-dirty) in sync.parquet" in n for n in rep.notes), rep.notes
    assert short_commit("unknown") == "unknown" and short_commit(None) == ""


def test_latest_complete_run_per_setup(tmp_path) -> None:
    write(tmp_path, "sync", sync_rows({"v1": 4.0, "v3": 1.0}), "aaaaaaaa", "2026-01-01T00:00:00Z")
    write(tmp_path, "sync", sync_rows({"v1": 4.0, "v3": 0.5}), "bbbbbbbb", "2026-01-02T00:00:00Z")
    write(tmp_path, "sync", sync_rows({"v3": 0.1}), "cccccccc", "2026-01-03T00:00:00Z")  # partial: v3 only
    write(tmp_path, "sync", sync_rows({"v3": 7.0}, engine="tp=1"), "dddddddd", "2026-01-04T00:00:00Z")
    latest = latest_complete(build_report(tmp_path).sync).set_index("engine")
    assert latest.loc["tp=2,ep=2 x2", "commit"] == "bbbbbbbb" and latest.loc["tp=2,ep=2 x2", "v3_seconds"] == 0.5
    assert latest.loc["tp=1", "commit"] == "dddddddd"  # a setup with one partial run: that run


def test_filters(tmp_path, simulated_rows) -> None:
    write(tmp_path, "sync", sync_rows(), "aaaaaaaa")
    write(tmp_path, "simulated", simulated_rows, "bbbbbbbb")
    assert set(build_report(tmp_path, Filters(suites=("sync",))).sync["kind"]) == {"measured"}
    assert set(build_report(tmp_path, Filters(kind="simulated")).sync["kind"]) == {"simulated"}
    assert set(build_report(tmp_path, Filters(commit="aaa")).sync["commit"]) == {"aaaaaaaa"}
    assert not build_report(tmp_path, Filters(hardware="CPU:TEST")).sync.empty
    with pytest.raises(KvmoveError, match=r"no rows .* match --hardware h100"):
        build_report(tmp_path, Filters(hardware="h100"))


def test_validation_and_costs_tables(tmp_path, simulated_rows) -> None:
    write(tmp_path, "simulated", simulated_rows)
    rep = build_report(tmp_path)
    val = rep.validation.set_index("figure")
    assert list(val.index) == ["vllm-qwen3-v2", "vllm-qwen3-v3"]
    v3 = val.loc["vllm-qwen3-v3"]
    assert v3["published"] == 3.49 and v3["used_for_costs"] == "no" and v3["source"].startswith("https://")
    assert v3["error_pct"] == pytest.approx(100 * (v3["predicted"] / 3.49 - 1))
    assert (rep.costs["kind"] == "default").all()  # no measured rows here: every cost is flagged
    assert any("without a measurement of ours" in n for n in rep.notes)
    sim = rep.sync.iloc[0]
    assert sim["kind"] == "simulated" and sim["constraints"] == "published" and sim["v3_published"] == 3.49
    assert sim["hardware"].startswith("sim") and "2+2 nodes" in sim["hardware"]  # the simulated cluster, not ours


def test_migration_table_per_prompt_length(tmp_path) -> None:
    write(tmp_path, "migration", migration_rows())
    table = build_report(tmp_path).migrations.set_index("prompt_len")
    assert list(table.index) == [64, 256, 1024] and list(table["migrations"]) == [2, 2, 2]
    assert table.loc[256, "seconds_min"] == pytest.approx(0.0256) and table.loc[256, "seconds_max"] == pytest.approx(
        0.0266
    )


def test_plots_are_real_pngs(tmp_path, simulated_rows) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    from kvmove.bench.plots import render_plots

    write(tmp_path / "r", "sync", sync_rows())
    write(tmp_path / "r", "simulated", simulated_rows)
    write(tmp_path / "r", "migration", migration_rows())
    plots = render_plots(build_report(tmp_path / "r"), tmp_path / "plots")
    assert {p.name for p in plots.paths} == {
        "sync_time.png",
        "validation.png",
        "bandwidth_vs_limit.png",
        "phases.png",
        "migration_latency.png",
        "priority_latency_cdf.png",
    }
    for path in plots.paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(path)
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.01  # not blank


def test_plot_labels_wrap_at_words_never_inside_one() -> None:
    from kvmove.bench.plots import wrap

    text = "qwen3-235b-a22b v3 · tp=4,pp=2,ep=8 → dp=16,ep=16 rdma-pull (published constraints) @349ca0e7-dirty"
    lines = wrap(text, 20).split("\n")
    assert " ".join(lines) == text and len(lines) > 1


def test_plots_without_rows_are_skipped_not_failed(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from kvmove.bench.plots import render_plots

    write(tmp_path / "r", "plan", [Row(kind="measured", suite="plan", name="p", seconds=1.0)])
    plots = render_plots(build_report(tmp_path / "r"), tmp_path / "plots")
    assert not plots.paths and len(plots.notes) == 6


def test_plots_without_matplotlib_name_the_extra(tmp_path, monkeypatch) -> None:
    import kvmove.bench.plots as plots_mod

    monkeypatch.setattr(plots_mod, "plt", None)
    write(tmp_path, "sync", sync_rows())
    with pytest.raises(KvmoveError, match=r"kvmove\[plots\]"):
        plots_mod.render_plots(build_report(tmp_path), tmp_path / "plots")


def test_the_validation_view_shows_each_figures_role_and_leave_one_source_out_error(tmp_path) -> None:
    """``bench report`` renders training and held-out figures apart and each leave-one-source-out error."""
    from typer.testing import CliRunner

    from kvmove.cli.main import app

    (check,) = [c for c in _validation_checks() if c.figure.key == "vllm-qwen3-v3"]
    write(tmp_path, "simulated", [_row_of(check)])
    out = CliRunner().invoke(app, ["bench", "report", "--results", str(tmp_path), "--format", "markdown",
                                   "--table", "validation"])  # fmt: skip
    assert out.exit_code == 0, out.output
    header = next(line for line in out.stdout.splitlines() if line.startswith("| figure"))
    assert "| role |" in header and "| leave one source out |" in header
    line = next(line for line in out.stdout.splitlines() if line.startswith("| vllm-qwen3-v3 "))
    assert f"| held-out | {check.error_pct:+.0f}% | {check.loso_error_pct:+.0f}% |" in line


def _validation_checks() -> list[Check]:
    from kvmove.bench.sim.costs import default_book
    from kvmove.bench.sim.figures import FIGURES
    from kvmove.bench.sim.validation import validate

    wanted = tuple(f for f in FIGURES if f.key in ("vllm-qwen3-v2", "vllm-qwen3-v3"))
    return validate(default_book(), wanted, loso={"vllm-qwen3-v3": 5.0})


def _row_of(c: Check) -> Row:
    from kvmove.bench.sim.costs import default_book
    from kvmove.bench.sim.rows import prediction_row
    from kvmove.bench.sim.validation import figure_setup

    return prediction_row(c.prediction, figure_setup(c.figure), default_book(), c.figure.key, c)


README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- validation table: begin -->", "<!-- validation table: end -->"


def _readme_table(table: pd.DataFrame) -> str:
    """The README's per-figure table from the report's validation table (``KVMOVE_WRITE_README=1`` rewrites it)."""

    def value(r: pd.Series, col: str) -> str:
        return f"{r[col] / 1e12:.3g} TB" if r["metric"] == "bytes" else f"{r[col]:.4g} s"

    def signed(v: object) -> str:
        return "" if v is None or pd.isna(v) else f"{v:+.0f}%".replace("-0%", "+0%")

    lines = [
        "| figure | role | published / measured | predicted | error | leave one source out | spread between passes |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for _, r in table.iterrows():
        spread = "" if r["pass_spread_pct"] is None or pd.isna(r["pass_spread_pct"]) else f"{r['pass_spread_pct']:.0f}%"
        lines.append(f"| {r['figure']} | {r['role']} | {value(r, 'published')} | {value(r, 'predicted')} | "
                     f"{signed(r['error_pct'])} | {signed(r['loso_error_pct'])} | {spread} |")  # fmt: skip
    return "\n".join(lines)


def test_the_readme_lists_every_figures_error_from_the_committed_rows() -> None:
    """Every published figure and held-out run of ours, as the committed simulated rows judge them, is in the
    README, good or bad."""
    from kvmove.bench.report import build_report

    table = build_report(README.parent / "results").validation
    expected = _readme_table(table)
    text = README.read_text()
    if os.environ.get("KVMOVE_WRITE_README") == "1":
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        README.write_text(f"{head}{BEGIN}\n\n{expected}\n\n{END}{tail}")
        text = README.read_text()
    assert BEGIN in text and END in text, "README lacks the validation table markers"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == expected, "README's validation table is stale: rerun with KVMOVE_WRITE_README=1"
    assert len(table) >= 29 and set(table["role"]) >= {"training", "held-out", "held-out (ours)"}
    ours = int(table["role"].str.contains("ours").sum())
    published = len(table) - ours
    nbytes = int(((table["metric"] == "bytes") & ~table["role"].str.contains("ours")).sum())
    counts = (
        f"{len(table)} figures: {published} published ({published - nbytes} times, {nbytes} byte count) and {ours} runs"
    )
    assert counts in text, f"README's summary of the validation table should read {counts!r}"
