"""megatron-core-named trainer shards (TP/PP/EP placed, grouped-GEMM experts) synced into the reference engine:
the engines' plans convert them to HF names by recorded views; every strategy verified against the HF
checkpoint the shards were imported from."""

from __future__ import annotations

import pytest

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.faults import FaultHooks
from kvmove.sync.driver.run import start
from kvmove.sync.driver.step import run_sync
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.formats import get_format
from kvmove.sync.planning.plan import plan_rank
from kvmove.sync.strategies import parse_strategies


@pytest.mark.parametrize(
    ("trainer", "engine", "all_direct"),
    [("tp=2,pp=2,ep=2", "tp=2,ep=2", True), ("tp=2,ep=2", "tp=4", False), ("tp=1", "tp=1", False)],
)
def test_plan_records_the_conversion_as_views_of_megatron_tensors(trainer: str, engine: str, all_direct: bool) -> None:
    cfg, tl, el = resolve_model("qwen3-moe-tiny"), TrainerLayout.parse(trainer), EngineLayout.parse(engine)
    source = get_format("megatron").source_tensors(cfg, tl)
    plan = plan_rank(cfg, el, el.coord(0), source=source)
    names = {r.hf_name for r in plan.regions}
    assert names <= {t.name for t in source.tensors(None)} and not any(n.startswith("model.") for n in names)
    # every region is a strided view of a Megatron tensor: q/k/v out of the per-group interleave, gate/up out of
    # fc1's per-TP-shard halves, the embedding without its padding (recorded over a finer shape where needed)
    assert all(r.src is not None for r in plan.regions)
    qkv = [r for r in plan.regions if r.hf_name.endswith("linear_qkv.weight")]
    # engine tp=1 reads both query groups' q rows: one view over (group, row, column)
    assert qkv and any(len(r.dst.shape) > 2 for r in qkv) is (el.tp == 1)
    own = get_format("megatron").ownership(cfg, tl)
    direct = DirectPlanner(own, source.tensors(None))
    dtypes = {p.name: p.dtype for p in plan.params}
    served = [
        r
        for r in plan.regions
        if any(direct.spans(r, t, dtypes[r.param]) is not None for t in direct.shard_holders(r, range(tl.world)))
    ]
    assert any(r.hf_name.endswith("linear_qkv.weight") for r in served)  # q/k/v read straight from a TP shard
    assert (len(served) == len(plan.regions)) is all_direct


@pytest.mark.parametrize("fmt", ["megatron", pytest.param("megatron-sequential", marks=pytest.mark.slow)])
def test_megatron_layout_every_strategy_verified(fmt: str) -> None:
    config = SyncConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=2,pp=2,ep=2"),
        engine=EngineLayout.parse("tp=2,ep=2"),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        transport="gloo",
        verify=True,
        tensor_format=fmt,
        placement=Placement(launcher="processes"),
        deadline_s=120.0,
    )
    cluster = start(config)
    try:
        direct = cluster.blueprint.direct_bytes("v3")
        hooks = FaultHooks((), config.engine)
        results = [run_sync(cluster, hooks, s, 1, i) for i, s in enumerate(config.strategies, start=1)]
    finally:
        cluster.close()
    for r in results:
        assert r.verified is True and r.live_engines == 2, (r.strategy, r.mismatches)
    assert direct > 0  # experts, embedding, linear_proj... read straight from the Megatron shards


@pytest.mark.parametrize(
    ("model", "fmt", "match"),
    [("qwen3-moe-tiny", "nope", "unknown checkpoint format"), ("kimi-k2-tiny", "megatron", "GQA")],
)
def test_bad_formats_are_refused_up_front(model: str, fmt: str, match: str) -> None:
    from kvmove.errors import KvmoveError
    from kvmove.sync.driver.checks import checked

    config = SyncConfig(
        model=resolve_model(model),
        trainer=TrainerLayout.parse("tp=2"),
        engine=EngineLayout.parse("tp=2"),
        strategies=tuple(parse_strategies("v3")),
        transport="gloo",
        tensor_format=fmt,
        placement=Placement(launcher="processes"),
    )
    with pytest.raises(KvmoveError, match=match):
        checked(config)
