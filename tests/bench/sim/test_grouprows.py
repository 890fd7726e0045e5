"""Per-group rows: one item's contribution, kept and added again wherever the same kind of item recurs."""

from __future__ import annotations

import numpy as np
import pytest

from kvmove.bench.sim.builder import _Builder, build_traffic
from kvmove.bench.sim.grouprows import GroupRows
from kvmove.bench.sim.groups import units
from kvmove.bench.sim.hardware import Cluster
from kvmove.bench.sim.models import sim_model
from kvmove.bench.sim.setup import SimSetup, TrainerSpec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.models.layout import EngineLayout


def test_a_snapshot_applied_to_another_group_adds_exactly_its_rows() -> None:
    rows = GroupRows(3, world=4, local=2)
    rows.t["send"][0, 1] = 5.0
    rows.e["pulls"][0, 0] = 2.0
    ops, nbytes = rows.collectives(2)
    ops[0, 3], nbytes[0, 3] = 1.0, 64.0
    rows.sources[0][(1, ("shard", (3,)))] += 2
    rows.max_request[0], rows.stage[0] = 7.0, 1
    c = rows.snapshot()
    rows.apply(2, c)
    rows.apply(2, c)
    assert rows.t["send"][2].tolist() == [0.0, 10.0, 0.0, 0.0]
    assert rows.e["pulls"][2].tolist() == [4.0, 0.0]
    assert rows.gather[2][1][2, 3] == 128.0 and rows.gather[2][0][1].sum() == 0.0
    assert rows.sources[2] == {(1, ("shard", (3,))): 4} and rows.max_request[2] == 7.0 and rows.stage[2] == 1
    rows.clear()
    assert not any(a[0].any() for a in rows.t.values()) and not rows.sources[0] and rows.max_request[0] == 0.0


@pytest.mark.parametrize("strategy", ["v1", "v2", "v3", "broadcast", "broadcast-pipelined"])
@pytest.mark.parametrize(
    ("trainer", "engine", "replicas"),
    [("tp=2,pp=2,ep=2", "tp=2,ep=2", 2), ("tp=2", "tp=1", 1), ("host:world=4", "tp=4", 1)],
)
def test_reused_item_rows_equal_building_every_item_in_place(strategy, trainer, engine, replicas) -> None:
    """The memo keys items by what prices them: with it, every array equals a build that adds each item itself."""
    s = SimSetup(
        sim_model("qwen3-moe-small"), TrainerSpec.parse(trainer), EngineLayout.parse(engine, replicas), Cluster(), 1, 1
    )
    sim = SIM_STRATEGIES[strategy]
    groups = units(s, sim)
    plain = _Builder(s, sim, len(groups), scratch=True)  # a scratch build keeps no memo
    for g, unit in enumerate(groups):
        for item in unit.items:
            plain.add(g, item)
        plain.reload(g, unit.reload, unit.layers)
    expected = plain.finish(np.array([u.times for u in groups]))
    got = build_traffic(s, sim)
    for side in ("t", "e"):
        for k, a in getattr(expected, side).items():
            np.testing.assert_array_equal(getattr(got, side)[k], a, err_msg=f"{side}[{k}]")
    assert set(got.gather) == set(expected.gather)
    for n, (ops, nbytes) in expected.gather.items():
        np.testing.assert_array_equal(got.gather[n][0], ops)
        np.testing.assert_array_equal(got.gather[n][1], nbytes)
    np.testing.assert_array_equal(got.max_request, expected.max_request)
    np.testing.assert_array_equal(got.stage, expected.stage)
