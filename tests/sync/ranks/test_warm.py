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
