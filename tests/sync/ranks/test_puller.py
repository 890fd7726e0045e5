"""An engine-side puller built from a picklable PullerInit in a process no launcher started (as a worker inside an
inference engine would), pulling packed regions from launched trainer ranks by address, without Ray."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch.multiprocessing as mp

from kvmove.engines import get_engine
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncConfig, SyncOptions
from kvmove.sync.driver.run import start
from kvmove.sync.ranks.control import PullerInit, RunSync, StepWeights
from kvmove.sync.strategies import STRATEGIES
from kvmove.transport import available_transports


def _pull_elsewhere(config: SyncConfig, init: bytes, out: Any) -> None:
    """A plain process: the engine's own model and plan, a puller from the init info, one sync, verified."""
    from kvmove.sync.planning.plan import plan_rank
    from kvmove.sync.ranks.puller import open_puller
    from kvmove.sync.verify import verify_streaming

    adapter, layout = get_engine("reference"), config.engine
    model = adapter.build(config.model, layout, layout.coord(0))
    plan = plan_rank(config.model, layout, layout.coord(0), engine=adapter)
    puller = open_puller(pickle.loads(init), model, plan)  # its own transport endpoint, from the init info
    stats = puller.run(1, STRATEGIES["v3"])
    result = verify_streaming(config.model, plan, model, config.seed, version=1)
    out.put((stats, result.ok, list(result.mismatches), plan.nbytes))
    puller.close()


def test_a_puller_from_init_info_pulls_without_a_launcher() -> None:
    if "nixl" not in available_transports():
        pytest.skip("needs a one-sided transport that any process can open: nixl")
    config = SyncConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=2,ep=2"),
        engine=EngineLayout.parse("tp=1"),
        strategies=(STRATEGIES["v3"],),
        transport="nixl",
        options=SyncOptions(direct=False),  # every region packed: pack requests and finish notes by address
        placement=Placement("processes"),
        deadline_s=60.0,
    )
    ranks = start(config)
    try:
        init: PullerInit = ranks.puller_init(0)
        assert pickle.loads(pickle.dumps(init)) == init  # plain data: addresses, endpoints, plans
        ranks.launcher.call(ranks.trainers, StepWeights(1), 60)
        loops = ranks.blueprint.trainer_syncs(STRATEGIES["v3"], 1, 1, {0})
        serving = [t.submit(RunSync(loop)) for t, loop in zip(ranks.trainers, loops, strict=True)]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        worker = ctx.Process(target=_pull_elsewhere, args=(ranks.config, pickle.dumps(init), out))
        worker.start()
        stats, ok, bad, nbytes = out.get(timeout=300)
        worker.join(60)
        trainer_stats = ranks.launcher.gather(serving, 60)  # every group released: the notes arrived
        memory = ranks.memory()  # what a soak records: every rank's resident memory
    finally:
        ranks.close()
    assert ok, bad[:5]
    assert stats.bytes_received >= nbytes and stats.pulls == len(init.pulls["v3"].pulls) > 1
    assert sum(t.pulls_served for t in trainer_stats) == stats.pulls
    assert [(m.side, m.rank) for m in memory] == [("trainer", 0), ("trainer", 1), ("engine", 0)]
    assert len({m.pid for m in memory}) == 3 and all(0 < m.rss_bytes <= m.peak_rss_bytes for m in memory)
