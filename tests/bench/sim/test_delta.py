"""Delta syncs priced: bytes from the encoding's owner, detection and apply passes, and their setup parameter."""

from __future__ import annotations

import dataclasses

import pytest

from kvmove.bench.results import Labels, Row, append_rows, load_results
from kvmove.bench.sim.costs import default_book
from kvmove.bench.sim.fractions import measured_fractions, parse_fractions
from kvmove.bench.sim.hardware import Cluster
from kvmove.bench.sim.measure import costs_from_rows
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.setup import SimSetup, TrainerSpec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout
from kvmove.sync.delta.encoding import delta_bytes

BOOK = default_book()
V3 = [SIM_STRATEGIES["v3"]]
FRACTIONS = (0.0, 0.001, 0.01, 0.02, 0.03, 0.05, 0.1, 0.3, 0.6, 0.9)


def _link_bound(delta: str | None = None, **kw: object) -> SimSetup:
    """A 4-layer Qwen3-235B slice over one 100 Gb/s NIC per node: the link, not memory, bounds the sync."""
    cfg = resolve_model("qwen3-235b-a22b", {"num_hidden_layers": 4})
    base: dict[str, object] = dict(trainer_nodes=2, engine_nodes=2, cluster=Cluster.parse("gpu=h100,nic_gbps=100"))
    base.update(kw)
    return SimSetup(
        cfg,
        TrainerSpec.parse("tp=4,pp=2,ep=8"),
        EngineLayout.parse("tp=8,ep=8", 2),
        delta=parse_fractions(delta) if delta is not None else None,
        **base,  # type: ignore[arg-type]
    )


def _at(fraction: float, **kw: object) -> object:
    (p,) = simulate(_link_bound(f"{fraction:g}", **kw), V3, BOOK)
    return p


def test_delta_bytes_come_from_the_encodings_owner_and_never_exceed_dense() -> None:
    (dense,) = simulate(_link_bound(), V3, BOOK)
    for f in (*FRACTIONS, 1.0):
        p = _at(f)
        assert p.bytes_moved <= dense.bytes_moved * (1 + 1e-12), f
        assert p.seconds >= p.speed_of_light_seconds * (1 - 1e-9)
    # one region of a pull's size at 2%: the owner's smallest encoding (gaps: a 16-bit gap and the 2-byte word per
    # changed word)
    each = 2 * 10**6
    assert delta_bytes(each, 0.02) == pytest.approx(0.04 * each, rel=1e-3)
    assert _at(0.02).bytes_moved == pytest.approx(0.04 * dense.bytes_moved, rel=0.02)


def test_monotone_in_the_changed_fraction_and_within_five_percent_of_dense_where_the_link_binds() -> None:
    (dense,) = simulate(_link_bound(), V3, BOOK)
    runs = [_at(f) for f in FRACTIONS]
    assert [p.bytes_moved for p in runs] == sorted(p.bytes_moved for p in runs)
    assert [p.seconds for p in runs] == sorted(p.seconds for p in runs)
    for p in [*runs, _at(1.0)]:
        assert p.seconds <= 1.05 * dense.seconds, p  # it falls back to dense per pull: only detection is added
    assert runs[3].seconds < 0.5 * dense.seconds  # 2% changed: several times below dense on this link


def test_at_fraction_zero_only_the_trainers_detection_remains() -> None:
    (dense,) = simulate(_link_bound(), V3, BOOK)
    zero = _at(0.0)
    assert zero.bytes_moved == 0 and zero.speed_of_light_seconds == 0
    assert zero.phases["load"] < dense.phases["load"] / 10  # nothing changed: nothing is landed, only pulls' calls
    (no_calls,) = simulate(_link_bound("0"), V3, BOOK.with_values({"load_call_s": 0.0}, "t"))
    assert no_calls.phases["load"] == 0.0
    assert zero.phases["pack"] > dense.phases["pack"]  # the compare pass over every packed byte
    assert zero.phases["transfer"] < dense.phases["transfer"] / 20  # per-pull operations only, no bytes
    no_detect = BOOK.with_values({"delta_detect_efficiency": 1.0}, "t")
    (cheap,) = simulate(_link_bound("0"), V3, no_detect)
    assert cheap.seconds < zero.seconds


def test_only_pulls_the_sync_can_send_as_deltas_are_priced_as_deltas() -> None:
    for strategy in ("broadcast",):
        (dense,) = simulate(_link_bound(), [SIM_STRATEGIES[strategy]], BOOK)
        (delta,) = simulate(_link_bound("0.02"), [SIM_STRATEGIES[strategy]], BOOK)
        assert delta.bytes_moved == dense.bytes_moved and delta.seconds == pytest.approx(dense.seconds)
    engine_fp8 = dict(dtype="fp8", quantize_on="engine")
    (dense,) = simulate(_link_bound(**engine_fp8), V3, BOOK)
    (delta,) = simulate(_link_bound("0.02", **engine_fp8), V3, BOOK)
    assert delta.bytes_moved == dense.bytes_moved  # the engine quantizes what it lands: always dense
    direct = _link_bound("0.02", direct=True)
    assert simulate(direct, V3, BOOK)[0].bytes_moved == _at(0.02).bytes_moved  # direct reads are planned packed


def test_fraction_flags_parse_or_refuse_in_one_line() -> None:
    assert parse_fractions("0.02").of("experts") == 0.02
    f = parse_fractions("attention=0.01,experts=0.03")
    assert (f.of("attention"), f.of("experts"), f.of("embeddings")) == (0.01, 0.03, 0.03)
    assert parse_fractions(f.text()) == f
    for bad, match in (
        ("mlp=0.1", "not CLASS=FRACTION"),
        ("1.5", r"lies in \[0, 1\]"),
        ("experts=lots", "is not a number"),
        (",", "names no fraction"),
    ):
        with pytest.raises(KvmoveError, match=match):
            parse_fractions(bad)
    with pytest.raises(KvmoveError, match="no delta rows"):
        measured_fractions(None)


def _delta_row(step: int, fraction: float, device: str, phases: dict[str, float]) -> Row:
    return Row(
        kind="measured",
        suite="delta",
        name=f"delta step {step}",
        model="qwen3-235b-a22b",
        bytes=1,
        seconds=1.0,
        phases=phases,
        extra={
            "device": device,
            "model_bytes": 4_000_000_000,
            "device_copy_gbps": 4000.0,
            "changed_fraction": {"attention": fraction, "experts": 2 * fraction},
            "changed_fraction_all": fraction,
        },
    )


def test_delta_rows_set_the_delta_costs_and_the_measured_fractions(tmp_path) -> None:
    """GPU delta rows set detection and apply (over the run's own copy rate); CPU ones set nothing; the changed
    fractions are the newest commit's medians, whatever device measured them."""
    gpu = {"detect_encode": 0.04, "apply": 0.03, "dense_land": 0.01}
    append_rows(tmp_path, "delta", [_delta_row(1, 0.5, "cpu", gpu)], Labels("cpu:x x2", {}, "old"))
    rows = load_results(tmp_path)
    assert costs_from_rows(rows).costs["delta_detect_efficiency"].kind == "default"  # a CPU row measures no GPU
    append_rows(tmp_path, "delta", [_delta_row(s, f, "cuda:0", gpu) for s, f in ((1, 0.04), (2, 0.02), (3, 0.03))],
                Labels("cpu:host x16", {}, "new"))  # fmt: skip
    rows = load_results(tmp_path)
    book = costs_from_rows(rows)
    detect, apply = book.costs["delta_detect_efficiency"], book.costs["delta_apply_efficiency"]
    assert detect.value == pytest.approx(4e9 / 0.04 / 2e12) and apply.value == pytest.approx(4e9 / 0.02 / 2e12)
    assert {r.commit for r in detect.rows} == {"new"} and len(detect.rows) == 3
    found = measured_fractions(rows)
    assert found.commit == "new" and found.rows == 3
    assert (found.fractions.of("attention"), found.fractions.of("experts")) == (0.03, 0.06)
    assert found.fractions.of("dense_mlp") == 0.03  # a class the rows did not see: the all-classes fraction


def test_measured_fraction_flag_reads_the_rows(tmp_path) -> None:
    from typer.testing import CliRunner

    from kvmove.cli.main import app

    gpu = {"detect_encode": 0.04, "apply": 0.03, "dense_land": 0.01}
    append_rows(tmp_path, "delta", [_delta_row(1, 0.02, "cuda:0", gpu)], Labels("cpu:host x16", {}, "abc"))
    args = ["bench", "simulate", "--model", "qwen3-moe-tiny", "--trainer", "tp=2,pp=2,ep=2", "--engine", "tp=2,ep=2",
            "--trainer-nodes", "1", "--engine-nodes", "1", "--strategy", "v3", "--results", str(tmp_path)]  # fmt: skip
    out = CliRunner().invoke(app, [*args, "--delta-fraction", "measured", "--json"])
    assert out.exit_code == 0, out.output
    assert "changed fractions measured at abc" in out.stdout and "delta (default=0.02" in out.stdout
    bad = CliRunner().invoke(app, [*args, "--delta-fraction", "2"])
    assert isinstance(bad.exception, KvmoveError) and "lies in [0, 1]" in str(bad.exception)


def test_setup_keeps_its_delta_in_the_traffic_cache() -> None:
    a, b = _link_bound("0.01"), _link_bound("0.2")
    assert simulate(a, V3, BOOK)[0].bytes_moved < simulate(b, V3, BOOK)[0].bytes_moved
    assert dataclasses.replace(a, delta=None).delta is None
