"""Direct pulls: arena layout, byte spans, eligibility, and syncs that use them (and that do not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.sync.config import SyncOptions
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.direct import ARENA_ALIGN, DirectPlanner, arena_layout, arena_layouts, byte_spans, shard_views
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.plan import plan_engine
from kvmove.sync.planning.recording import StridedView
from kvmove.sync.strategies import parse_strategies


def _apply(spans: np.ndarray, src: torch.Tensor, dst: torch.Tensor) -> None:
    s, d = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for so, do, n in spans.tolist():
        d[do : do + n] = s[so : so + n]


@pytest.mark.parametrize(
    ("src_slice", "dst_slice"),
    [
        ((slice(0, 4), slice(None)), (slice(2, 6), slice(None))),  # rows: one run
        ((slice(None), slice(2, 6)), (slice(None), slice(0, 4))),  # columns: one run per row
        ((slice(1, 3), slice(4, 8)), (slice(5, 7), slice(0, 4))),
    ],
)
def test_byte_spans_copy_exactly_the_view(src_slice: tuple[slice, ...], dst_slice: tuple[slice, ...]) -> None:
    src = torch.arange(64, dtype=torch.bfloat16).view(8, 8)
    dst = torch.zeros(8, 8, dtype=torch.bfloat16)
    want = dst.clone()
    want[dst_slice] = src[src_slice]
    spans = byte_spans(StridedView.of(src[src_slice]), StridedView.of(dst[dst_slice]), 2)
    _apply(spans, src, dst)
    assert torch.equal(dst, want)
    rows = src[src_slice].shape[0]
    assert len(spans) == (1 if src[src_slice].is_contiguous() and dst[dst_slice].is_contiguous() else rows)


def test_arena_holds_every_raw_shard_aligned_and_disjoint() -> None:
    cfg = resolve_model("qwen3-moe-tiny")
    ownership = Ownership(cfg, TrainerLayout.parse("tp=2,pp=2,ep=2"))
    tensors = hf_tensors(cfg)
    every = arena_layouts(ownership, tensors)  # one pass for all ranks: the same layouts as rank by rank
    for rank in range(ownership.layout.world):
        layout = arena_layout(ownership, tensors, rank)
        assert every[rank] == layout
        held = {t.name for t in tensors for h in ownership.slices(t) if h.rank == rank}
        assert set(layout.offsets) == held
        assert all(off % ARENA_ALIGN == 0 for off in layout.offsets.values())
        arena = torch.zeros(layout.nbytes, dtype=torch.uint8)
        views = shard_views(arena, layout, {t.name: t.dtype for t in tensors})
        for i, v in enumerate(views.values()):
            v.fill_(i + 1)
        assert all(bool((v == i + 1).all()) for i, v in enumerate(views.values()))  # no two shards overlap


def test_planner_takes_regions_inside_a_raw_shard_and_leaves_the_rest_packed() -> None:
    cfg = resolve_model("qwen3-moe-tiny")
    trainer, engine = TrainerLayout.parse("tp=2,pp=2,ep=2"), EngineLayout.parse("tp=2")
    plans = plan_engine(cfg, engine)
    strategies = parse_strategies("v1,v2,v3")
    bp = Blueprint(cfg, trainer, engine, plans, strategies, SyncOptions())
    assert bp.direct_bytes("v1") == 0  # v1 gathers everything globally: nothing is read from an arena
    assert 0 < bp.direct_bytes("v3") < sum(p.nbytes for p in plans)  # experts and same-split TP shards
    planner = DirectPlanner(bp.ownership, hf_tensors(cfg))
    region = next(r for r in plans[0].regions if r.src is not None)
    holders = planner.shard_holders(region, range(trainer.world))
    assert holders and planner.spans(region, holders[0], torch.float32) is None  # a dtype cast is packed
    outside = [t for t in range(trainer.world) if t not in holders]
    assert all(planner.spans(region, t, region.dtype) is None for t in outside)
    # tensors read only directly are never gathered: v3's trainer loops skip them
    needed = bp.needed["v3"]
    loops = bp.trainer_syncs(strategies[2], 1, 1, set(range(engine.world)))
    assert {n for ts in loops for _, names in ts.groups for n in names} == needed
    no_direct = Blueprint(cfg, trainer, engine, plans, strategies, SyncOptions(direct=False))
    assert no_direct.direct_bytes("v3") == 0 and len(no_direct.needed["v3"]) > len(needed)
