"""The report: tolerant loading, tables, markdown/CSV, and real PNG plots."""

from __future__ import annotations

import io

import pandas as pd
import pytest

from kvmove.bench.report import build_report, to_csv, to_markdown
from kvmove.bench.results import Labels, Row, append_rows
from kvmove.errors import KvmoveError

LABELS = Labels("cpu:test x2", {"kvmove": "0"}, "abc")


def _sync_rows() -> list[Row]:
    rows = []
    for strategy, seconds in (("v1", 4.0), ("v3", 1.0), ("broadcast", 8.0)):
        rows.append(
            Row(
                kind="measured",
                suite="sync",
                name=f"sync {strategy}",
                model="qwen3-moe-tiny",
                trainer="tp=2,pp=2,ep=2",
                engine="tp=2,ep=2 x2",
                strategy=strategy,
                transport="nixl",
                bytes=10**9,
                seconds=seconds,
                gbps=1.0 / seconds,
                phases={"gather": 0.1, "pack": 0.2, "transfer": seconds / 2, "load": 0.1},
                link_limit_gbps=3.0,
            )
        )
    return rows


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
    append_rows(tmp_path, "sync", _sync_rows(), LABELS)
    (tmp_path / "bad.parquet").write_bytes(b"\x00garbage")
    pd.DataFrame(
        [{"kind": "measured", "suite": "sync", "strategy": "v2", "seconds": 2.0, "from_future": 1}]
    ).to_parquet(tmp_path / "newer.parquet")
    rep = build_report(tmp_path)
    assert any("bad.parquet is unreadable" in n for n in rep.notes)
    assert any("from_future" in n for n in rep.notes) and "from_future" in rep.rows.columns
    v3 = rep.sync[rep.sync["strategy"] == "v3"].iloc[0]
    assert v3["speedup_vs_v1"] == pytest.approx(4.0) and v3["speedup_vs_broadcast"] == pytest.approx(8.0)
    assert v3["pct_of_link_limit"] == pytest.approx(100 / 3)


def test_validation_and_costs_tables_markdown_and_csv(tmp_path, simulated_rows) -> None:
    append_rows(tmp_path, "simulated", simulated_rows, LABELS)
    rep = build_report(tmp_path)
    val = rep.validation.set_index("figure")
    assert list(val.index) == ["vllm-qwen3-v2", "vllm-qwen3-v3"]
    v3 = val.loc["vllm-qwen3-v3"]
    assert v3["published"] == 3.49 and v3["used_for_costs"] == "no" and v3["source"].startswith("https://")
    assert v3["error_pct"] == pytest.approx(100 * (v3["predicted"] / 3.49 - 1))
    md = to_markdown(rep)
    assert "Simulator validation" in md and "| vllm-qwen3-v3 | Qwen3-235B-A22B V3 | v3 | seconds | 3.49 |" in md
    csv = pd.read_csv(io.StringIO(to_csv(rep)))
    assert {"sync", "validation", "costs"} <= set(csv["table"])
    assert (rep.costs["kind"] == "default").all()  # no measured rows here: every cost is flagged
    assert any("without a measurement of ours" in n for n in rep.notes)


def test_plots_are_real_pngs(tmp_path, simulated_rows) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    from kvmove.bench.plots import render_plots

    append_rows(tmp_path / "r", "sync", _sync_rows(), LABELS)
    append_rows(tmp_path / "r", "simulated", simulated_rows, LABELS)
    migration = [
        Row(kind="measured", suite="migration", name=f"m{n}", seconds=n / 1e4, bytes=n * 1000, extra={"prompt_len": n})
        for n in (128, 512, 2048)
    ]
    append_rows(tmp_path / "r", "migration", migration, LABELS)
    plots = render_plots(build_report(tmp_path / "r"), tmp_path / "plots")
    names = {p.name for p in plots.paths}
    assert {"sync_time.png", "validation.png", "bandwidth_vs_limit.png", "phases.png", "migration_latency.png"} <= names
    assert any("priority_latency_cdf.png skipped" in n for n in plots.notes)
    for path in plots.paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(path)
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.01  # not blank


def test_plots_without_rows_are_skipped_not_failed(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from kvmove.bench.plots import render_plots

    append_rows(tmp_path / "r", "plan", [Row(kind="measured", suite="plan", name="p", seconds=1.0)], LABELS)
    plots = render_plots(build_report(tmp_path / "r"), tmp_path / "plots")
    assert not plots.paths and len(plots.notes) == 6


def test_plots_without_matplotlib_name_the_extra(tmp_path, monkeypatch) -> None:
    import kvmove.bench.plots as plots_mod

    monkeypatch.setattr(plots_mod, "plt", None)
    append_rows(tmp_path, "sync", _sync_rows(), LABELS)
    with pytest.raises(KvmoveError, match=r"kvmove\[plots\]"):
        plots_mod.render_plots(build_report(tmp_path), tmp_path / "plots")


def test_cli_report_formats(tmp_path, capsys) -> None:
    from kvmove.cli.report import report

    append_rows(tmp_path, "sync", _sync_rows(), LABELS)
    report(tmp_path, None, "csv")
    assert capsys.readouterr().out.startswith("table,")
    report(tmp_path, None, "table")
    assert "weight sync" in capsys.readouterr().out
    with pytest.raises(KvmoveError, match="unknown --format"):
        report(tmp_path, None, "xml")
