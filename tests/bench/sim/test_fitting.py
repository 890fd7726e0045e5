"""The joint fit: least squared log error over every training figure, inside each parameter's range; a parameter
two sources inform survives leaving one out; one no remaining figure informs keeps its cited default."""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import numpy as np
import pytest

from kvmove.bench.sim import fitting
from kvmove.bench.sim.costs import Cost, default_book, replace_cost
from kvmove.bench.sim.figures import FIGURES
from kvmove.bench.sim.fitting import INFORMS, PARAMS, TRAINING, Param, check_training, fit, informing
from kvmove.errors import KvmoveError

BY_KEY = {f.key: f for f in FIGURES}


class _Fake(NamedTuple):
    key: str
    value: float
    seconds: Any


def _solve_fakes(monkeypatch, free: tuple[Param, ...], a: float, b: float) -> dict[str, float]:
    """Two figures, each a known function of loader_tensor_s (a) and reload_layer_s (b), published at (a, b)."""
    model = (lambda x, y: 100 * x + 10 * y, lambda x, y: 50 * x + 200 * y)
    figures = tuple(_Fake(f"f{i}", m(a, b), m) for i, m in enumerate(model))
    predict = lambda f, book: f.seconds(book["loader_tensor_s"], book["reload_layer_s"])  # noqa: E731
    monkeypatch.setattr(fitting, "predicted", predict)
    x = fitting._solve(default_book(), free, figures)  # type: ignore[arg-type]
    return {p.name: float(v) for p, v in zip(free, np.exp(x), strict=True)}


def test_the_solver_finds_the_joint_least_squares_fit(monkeypatch) -> None:
    free = (Param("loader_tensor_s", 1e-6, 1e-2), Param("reload_layer_s", 1e-5, 1.0))
    got = _solve_fakes(monkeypatch, free, 1e-3, 2e-3)
    assert got["loader_tensor_s"] == pytest.approx(1e-3, rel=1e-3)
    assert got["reload_layer_s"] == pytest.approx(2e-3, rel=1e-3)


def test_the_solver_keeps_each_parameter_inside_its_range(monkeypatch) -> None:
    free = (Param("loader_tensor_s", 1e-6, 1e-2), Param("reload_layer_s", 1e-5, 1e-3))
    got = _solve_fakes(monkeypatch, free, 1e-3, 2e-3)  # the exact fit would need reload_layer_s = 2e-3
    assert got["reload_layer_s"] == pytest.approx(1e-3, rel=1e-6)
    assert got["loader_tensor_s"] > 1e-3  # takes up what the bounded parameter cannot


def test_a_parameter_two_sources_inform_is_still_fitted_when_one_is_left_out() -> None:
    both = (BY_KEY["pplx-kimi"], BY_KEY["lmsys-qwen3-235b-rdma"])
    assert set(informing("nic_efficiency")) >= {f.key for f in both}
    full = fit(default_book(), both)
    assert full.values["nic_efficiency"].figures == ("pplx-kimi", "lmsys-qwen3-235b-rdma")
    without = fit(default_book(), both, leave_out=BY_KEY["pplx-kimi"].source)
    cost = without.book.costs["nic_efficiency"]
    assert cost.kind == "fitted" and [r.name for r in cost.rows] == ["lmsys-qwen3-235b-rdma"]
    assert without.values["nic_efficiency"].figures == ("lmsys-qwen3-235b-rdma",)
    assert without.book.costs["loader_tensor_s"].kind == "default"  # no training figure here informs it


def test_the_engine_loader_has_two_sources_so_leaving_either_out_still_fits_it() -> None:
    """checkpoint-engine's vLLM and slime's SGLang both land tensor by tensor through the engine's own loader."""
    both = (BY_KEY["ckpt-qwen3-235b-8xh800-p2p"], BY_KEY["slime-qwen3-30b-colocated"])
    assert set(informing("loader_tensor_s")) == {f.key for f in both}
    assert both[0].source != both[1].source
    for left, kept in ((both[0], both[1]), (both[1], both[0])):
        without = fit(default_book(), both, leave_out=left.source)
        cost = without.book.costs["loader_tensor_s"]
        assert cost.kind == "fitted" and [r.name for r in cost.rows] == [kept.key], left.key
        assert without.values["loader_tensor_s"].figures == (kept.key,)
        alone = fitting.predicted(kept, without.book)
        assert alone == pytest.approx(kept.value, rel=0.02), kept.key  # one free parameter meets its one figure


def test_a_parameter_left_without_training_figures_keeps_its_cited_default() -> None:
    only = (BY_KEY["ckpt-qwen3-235b-8xh800-p2p"],)
    result = fit(default_book(), only, leave_out=only[0].source)
    for name in ("loader_tensor_s", "reload_layer_s"):
        cost = result.book.costs[name]
        assert cost.kind == "default" and "github.com/vllm-project/vime" in cost.note, name
        assert not result.values[name].figures
    # vime's 14 ms per ~170 tensors of Qwen3-30B-A3B, less the scan of its 128 experts' mapping (1.5 x 128 entries)
    scan = 1.5 * 128 * result.book["loader_scan_s"]
    assert result.book["loader_tensor_s"] + scan == pytest.approx(14e-3 / 170, rel=0.01)
    assert result.book.costs["loader_scan_s"].kind == "default"  # a published measurement, never fitted
    assert result.book["loader_scan_s"] == pytest.approx(6.67 / 179e6)


def test_training_figures_inform_exactly_what_they_declare(repo_validation) -> None:
    """A training figure declares a parameter when moving it across its range moves the prediction by INFORMS x or
    more (the other parameters at their fitted values), and only then."""
    assert repo_validation.fit is not None
    book = repo_validation.fit.book
    for key, declared in TRAINING.items():
        f = BY_KEY[key]
        for p in PARAMS:
            ends = [fitting.predicted(f, replace_cost(book, Cost(p.name, v, "user"))) for v in (p.low, p.high)]
            moves = abs(math.log(ends[1] / ends[0])) >= math.log(INFORMS)
            assert moves == (p.name in declared), (key, p.name, ends)


def test_a_bad_training_set_is_refused(monkeypatch) -> None:
    check_training(FIGURES)
    cases = {
        "two figures of 'vLLM blog (RDT)'": {**TRAINING, "vllm-qwen3-v3": ("reload_layer_s",)},
        "unknown parameters": {**TRAINING, "pplx-kimi": ("warp_speed",)},
        "not a published figure": {**TRAINING, "moon-landing": ("nic_efficiency",)},
        "no training figure informs packed_bucket_s": {**TRAINING, "skyrl-qwen3-broadcast": ("nic_efficiency",)},
    }
    for message, training in cases.items():
        monkeypatch.setattr(fitting, "TRAINING", training)
        with pytest.raises(KvmoveError, match=re.escape(message)):
            check_training(FIGURES)
