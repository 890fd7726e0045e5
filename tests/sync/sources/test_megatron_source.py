"""megatron-core-named trainer shards (TP/PP/EP placed, grouped-GEMM experts) synced into the reference engine:
the engines' plans convert them to HF names by recorded views; every strategy verified against the HF
checkpoint the shards were imported from."""

from __future__ import annotations

import pytest

from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models import resolve_model
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.faults import FaultHooks
from kvmove.sync.driver.run import start
from kvmove.sync.driver.step import run_sync
from kvmove.sync.planning.formats import get_format
from kvmove.sync.planning.plan import plan_rank
from kvmove.sync.strategies import parse_strategies


def test_plan_records_the_conversion_as_views_of_megatron_tensors() -> None:
    cfg, trainer, engine = resolve_model("qwen3-moe-tiny"), TrainerLayout.parse("tp=2,ep=2"), EngineLayout.parse("tp=2")
    source = get_format("megatron").source_tensors(cfg, trainer)
    plan = plan_rank(cfg, engine, engine.coord(0), source=source)
    names = {r.hf_name for r in plan.regions}
    assert names <= {t.name for t in source.tensors(None)} and not any(n.startswith("model.") for n in names)
    experts = [r for r in plan.regions if ".experts.linear_fc1.weight" in r.hf_name]
    assert experts and all(r.src is not None for r in experts)  # gate/up: narrows of the grouped weight
    embed = next(r for r in plan.regions if r.hf_name == "embedding.word_embeddings.weight")
    assert embed.src is not None


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
