from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmove.engines import EngineAdapter, get_engine
from kvmove.errors import PlanError, UnrecordableOpError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout
from kvmove.sync.planning.plan import Box, plan_engine, plan_rank, relative_view, view_box
from kvmove.sync.planning.recording import StridedView

LAYOUTS = [
    ("qwen3-moe-tiny", "tp=2,dp=2,ep=4"),
    ("qwen3-moe-tiny", "tp=4,pp=3"),
    ("kimi-k2-tiny", "tp=2,pp=2"),
    ("kimi-k2-tiny", "dp=4,ep=4"),
    ("qwen2-tiny", "tp=4,pp=2"),
]


@pytest.mark.parametrize(("model", "engine"), LAYOUTS)
def test_template_reuse_equals_full_dry_run(model: str, engine: str) -> None:
    cfg, layout = resolve_model(model), EngineLayout.parse(engine)
    for reused, full in zip(plan_engine(cfg, layout), plan_engine(cfg, layout, reuse=False), strict=True):
        assert sorted(reused.regions) == sorted(full.regions)
        assert sorted(reused.params) == sorted(full.params)


@pytest.mark.parametrize(("model", "engine"), LAYOUTS)
def test_regions_tile_parameters_without_overlap(model: str, engine: str) -> None:
    cfg, layout = resolve_model(model), EngineLayout.parse(engine)
    for plan in plan_engine(cfg, layout):
        masks = {p.name: torch.zeros(p.shape, dtype=torch.int32) for p in plan.params}
        for r in plan.regions:
            r.dst.apply(masks[r.param]).add_(1)
        for name, mask in masks.items():
            assert int(mask.max()) == 1, f"{name} written twice"
            unwritten = int((mask == 0).sum())
            assert unwritten == 0 or "embed" in name or "lm_head" in name, name  # only vocab padding


def test_full_size_kimi_plan_is_cheap_and_exact() -> None:
    cfg, layout = resolve_model("kimi-k2"), EngineLayout.parse("tp=32,ep=32")
    plan = plan_rank(cfg, layout, layout.coord(7))
    experts = [r for r in plan.regions if ".experts." in r.param]
    # 60 MoE layers x 12 local experts x 3 projections, each a whole expert tensor
    assert len(experts) == 60 * 12 * 3
    assert {r.hf_name.split(".")[5] for r in experts} == {str(e) for e in range(84, 96)}
    assert sum(r.nbytes for r in experts) == 60 * 12 * 3 * 2048 * 7168 * 2


def test_unrecordable_engine_loader_is_a_plan_error() -> None:
    ref = get_engine("reference")

    def peeking_load(model, weights):
        for name, w in weights:
            if name.endswith("q_norm.weight"):
                w.float()
        return ref.load_weights(model, weights)

    bad = EngineAdapter("peeking", ref.build, peeking_load)
    cfg, layout = resolve_model("qwen3-tiny"), EngineLayout()
    with pytest.raises(UnrecordableOpError, match=r"'float'.*q_norm"):
        plan_rank(cfg, layout, layout.coord(0), engine=bad)


def test_loader_that_skips_a_parameter_is_caught() -> None:
    ref = get_engine("reference")

    def lazy_load(model, weights):
        return ref.load_weights(model, ((n, w) for n, w in weights if "k_norm" not in n))

    cfg, layout = resolve_model("qwen3-tiny"), EngineLayout()
    with pytest.raises(PlanError, match=r"k_norm.weight receives no data"):
        plan_rank(cfg, layout, layout.coord(0), engine=EngineAdapter("lazy", ref.build, lazy_load))


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    data=st.data(),
)
def test_view_box_and_relative_view(shape: list[int], data) -> None:
    full = torch.arange(int(torch.tensor(shape).prod())).view(*shape)
    view = full
    for d in range(len(shape)):
        start = data.draw(st.integers(0, shape[d] - 1))
        length = data.draw(st.integers(1, shape[d] - start))
        view = view.narrow(d, start, length)
    if len(shape) > 1 and data.draw(st.booleans()):
        view = view.transpose(0, len(shape) - 1)
    sv = StridedView.of(view)
    box = view_box(sv, shape)
    assert box is not None and box.numel == view.numel()
    outer = Box(
        tuple(max(0, a - 1) for a in box.start), tuple(min(s, b + 1) for s, b in zip(shape, box.stop, strict=True))
    )
    local = full[outer.slices()].contiguous()
    assert torch.equal(relative_view(sv, shape, outer).apply(local), view)
    assert torch.equal(sv.apply(full), view)


def test_view_box_bounds_strided_views() -> None:
    # every other element: the smallest box holding them (the view reads inside it)
    assert view_box(StridedView(0, (3,), (2,)), (6,)) == Box((0,), (5,))
    # query rows of two groups of a fused [q, q, k, v] x 2 tensor (rows of 4): rows 0-1 and 4-5
    assert view_box(StridedView(0, (2, 2, 4), (16, 4, 1)), (8, 4)) == Box((0, 0), (6, 4))
    assert view_box(StridedView(1, (2,), (5,)), (3, 3)) is None  # a view dim mixing tensor dims
