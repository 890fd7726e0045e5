"""Warm start: a source creates at init every process group its gathers use (so a first sync costs what the next
ones do), and engine ranks interleave packed pulls across trainer ranks (v3 overlap)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvmove.layout import TrainerLayout
from kvmove.models import resolve_model
from kvmove.ports import free_port
from kvmove.sync.planning.schedule import Pull
from kvmove.sync.ranks.control import Address
from kvmove.sync.ranks.engine import interleaved
from kvmove.sync.ranks.source import SourceContext, seeded_source
from kvmove.sync.strategies import Gather


@pytest.mark.parametrize("scope", [Gather.STAGE, Gather.GLOBAL, Gather.ROOT])
def test_warm_creates_every_group_a_sync_then_uses(scope: Gather) -> None:
    cfg, layout = resolve_model("qwen3-moe-tiny"), TrainerLayout.parse("tp=2,pp=2")
    store = Address("127.0.0.1", free_port())
    out: dict[int, Any] = {}
    errors: list[BaseException] = []
    done = threading.Barrier(layout.world)

    def rank(r: int) -> None:
        source = None
        try:
            source = seeded_source(SourceContext(cfg, layout, r, "cpu", 0, store, 60.0))
            source.warm({scope})
            warmed = set(source.coll._groups)  # type: ignore[attr-defined]
            calls = source.collective_calls
            names = [m.name for m in source.metadata()]
            for _ in source.materialize(names, scope):
                pass
            out[r] = (warmed, set(source.coll._groups), calls, source.collective_calls)  # type: ignore[attr-defined]
        except BaseException as exc:
            errors.append(exc)
        finally:  # NOTE: rank 0's source hosts the store: it stays alive until every rank is done with it
            done.wait(120)
            del source

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(layout.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for warmed, used, calls_at_init, calls in out.values():
        assert used <= warmed  # materializing created no group the warm start had not
        assert calls_at_init == 0 and calls > 0  # warm-up collectives are not counted as a sync's
    assert any(warmed for warmed, *_ in out.values())


def _pull(group: int, trainer: int) -> Pull:
    return Pull(group, trainer, (), 1, ())


def test_interleaved_alternates_trainer_ranks_keeping_each_ranks_group_order() -> None:
    pulls = [_pull(0, 0), _pull(1, 0), _pull(2, 0), _pull(3, 1), _pull(4, 1)]  # stage 0's groups, then stage 1's
    order = interleaved(pulls, range(5))
    assert order == [0, 3, 1, 4, 2]
    for t in (0, 1):
        mine = [pulls[i].group for i in order if pulls[i].trainer == t]
        assert mine == sorted(mine)


def test_trainer_builds_and_runs_its_pack_programs_at_init() -> None:
    """Pulls served from raw shards get their programs at init, one per slot (a Triton kernel compiles there, in
    the warm-up run): every cover quantizes straight into the slot, a few launches for a whole layer's experts."""
    import torch

    from kvmove.layout import EngineLayout
    from kvmove.sync.config import SyncConfig
    from kvmove.sync.driver.dryrun import build_plans
    from kvmove.sync.planning.blueprint import Blueprint
    from kvmove.sync.ranks.source import ShardedSource
    from kvmove.sync.ranks.trainer import TrainerRank
    from kvmove.sync.strategies import STRATEGIES

    v3 = STRATEGIES["v3"]
    config = SyncConfig(resolve_model("qwen3-moe-fp8-tiny"), TrainerLayout(), EngineLayout(), (v3,))
    plans, _ = build_plans(config)
    blueprint = Blueprint(config.model, config.trainer, config.engine, plans, [v3], config.options)
    specs = blueprint.specs("v3", 0)[0]
    source = ShardedSource(config.model, config.trainer, 0, None)  # type: ignore[arg-type]  # one rank: no gathers
    source.step(0)
    count, nbytes = blueprint.slot_sizes()[0]["v3"]
    rank = TrainerRank(source, {"v3": [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]}, 0)
    rank.register_pulls("v3", 0, specs)
    assert set(rank._programs) == {("v3", 0, p, s) for p in specs for s in range(count)}
    covers = sum(len(s) for _, s in specs.values())
    launches = sum(p.program.launches for p in rank._programs.values()) // count
    assert all(not p.program.scratch_bytes for p in rank._programs.values()) and 2 * launches < covers
    assert rank.slots["v3"][0].any() and not rank.slots["v3"][1].any()  # warmed on slot 0 only
