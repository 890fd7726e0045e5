"""Pulls landing through a bounded staging window (kvmove.vllm.receiver), without vLLM: kvmove's own pull
loop and landers over the reference engine's plan of a tiny model, a stand-in trainer packing real bytes, and a
commit that records what each unit held. Every unit must commit exactly once, whole and bit-exact, in a window of
one slot for v1 and v3 (pipelined: landing and commits on the loader thread), more where the landing order opens
more units at once (v2 with two trainer ranks), and never over a budget set below that."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.weights import seeded_checkpoint
from kvmove.sync.config import SyncOptions
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.plan import Box, plan_rank
from kvmove.sync.planning.recording import replay
from kvmove.sync.ranks.control import Packed
from kvmove.sync.strategies import parse_strategies
from kvmove.sync.transforms import Held, pack
from kvmove.vllm.receiver import ReceiveTarget, StagedRank, Stager, Window
from kvmove.vllm.staging import Budget, staging_units, window_layout

MODEL = "qwen2-tiny"


class Trainer:
    """Packs each requested pull from the full checkpoint into a serve slot (what a trainer rank does)."""

    def __init__(self, specs: dict[int, Any], weights: dict[str, torch.Tensor]) -> None:
        self.specs, self.weights, self.slots = specs, weights, {}
        self.recv: list[torch.Tensor] = []
        self.dense: dict[int, bool] = {}

    def request(self, trainer: int, sync_id: int, pull_id: int, dense: bool = False) -> Any:
        self.dense[pull_id] = dense
        return trainer, pull_id

    def wait(self, handle: Any) -> Packed:
        trainer, pull_id = handle
        _, specs = self.specs[trainer][pull_id]
        slot = torch.zeros(1 << 22, dtype=torch.uint8)
        layout = pack(slot, specs, [Held(self.weights[s.tensor], Box.full(s.shape)) for s in specs])
        self.slots[pull_id] = slot
        return Packed(pull_id, layout.nbytes)

    def read(self, trainer: int, slot: int, recv: int, nbytes: int) -> float:
        self.recv[recv][:nbytes].copy_(self.slots.pop(slot)[:nbytes])
        return 0.0

    def finish(self, trainer: int, sync_id: int, group: int, slot: int, read_s: float = -1.0) -> None:
        pass


def _engine(strategy: str, trainer: str = "tp=1", budget: int = 0) -> Any:
    cfg = resolve_model(MODEL)
    layout = EngineLayout()
    plan = plan_rank(cfg, layout, layout.coord(0))
    plan = dataclasses.replace(plan, staged=frozenset(p.name for p in plan.params if "norm" not in p.name))
    strategies = parse_strategies(strategy)
    bp = Blueprint(cfg, TrainerLayout.parse(trainer), layout, [plan], strategies, SyncOptions(direct=False))
    live = {p.name: torch.zeros(p.shape, dtype=p.dtype) for p in plan.params}
    committed: list[str] = []
    seen: dict[str, torch.Tensor] = {}

    def commit(unit: str, views: Any) -> None:
        committed.append(unit)
        for name, view in views.items():
            live[name].copy_(view)
            seen[name] = view

    def fill(unit: str, views: Any) -> None:
        raise AssertionError("a full sync fills nothing from the live model")

    units = staging_units(plan.params, plan.staged)
    window = Window(window_layout(units, plan.params), plan.params, "cpu")
    stager = Stager(window, {n: t for n, t in live.items() if n not in plan.staged}, commit, fill)
    (count, size) = bp.recv_sizes(0)[strategies[0].name]
    recv = {strategies[0].name: [torch.zeros(size, dtype=torch.uint8) for _ in range(count)]}
    rank = StagedRank(ReceiveTarget(stager), plan, recv, stager, Budget(budget))
    return cfg, plan, bp, rank, live, committed, units, stager, recv


def _sync(strategy: str, trainer: str = "tp=1", budget: int = 0) -> Any:
    cfg, plan, bp, rank, live, committed, units, stager, recv = _engine(strategy, trainer, budget)
    (s,) = parse_strategies(strategy)
    weights = seeded_checkpoint(cfg, 1, 1)
    client = Trainer(bp.specs(s.name, 0), weights)
    client.recv = recv[s.name]
    rank.run_sync(1, s, bp.pulls[s.name][0], client)
    want = {p.name: torch.zeros(p.shape, dtype=p.dtype) for p in plan.params}
    for r in plan.regions:
        r.dst.apply(want[r.param]).copy_(replay(r.ops, weights[r.hf_name]))
    _SEEN.update(requested=client.dense, pulls=bp.pulls[s.name][0], plan=plan)
    return live, want, committed, units, stager


_SEEN: dict[str, Any] = {}


def test_pulls_with_staged_parameters_are_asked_for_whole_and_the_rest_may_come_as_deltas() -> None:
    # a delta patches the bytes a parameter holds; a staged unit's window does not hold the live bytes, so the
    # engine asks the trainer for those pulls whole (the trainer then refreshes its image of them)
    _sync("v1")
    pulls, plan, requested = _SEEN["pulls"], _SEEN["plan"], _SEEN["requested"]
    assert pulls.plan is not None
    staged_pull = {}
    for i, pull in enumerate(pulls.pulls):
        if not pull.direct:
            regions = [r for k in pull.entries for r in pulls.plan.entries[k].regions]
            staged_pull[i] = any(plan.regions[r].param in plan.staged for r in regions)
    assert set(requested) == set(staged_pull)
    assert requested == staged_pull, "dense exactly where a pull lands in a staged unit"
    assert any(staged_pull.values()) and not all(staged_pull.values()), "the model has both kinds"


@pytest.mark.parametrize("strategy", ["v1", "v3"])
def test_every_unit_commits_once_whole_through_one_slot(strategy: str) -> None:
    live, want, committed, units, stager = _sync(strategy)
    assert sorted(committed) == sorted(units) and len(committed) == len(set(committed))
    assert stager.window.layout.slots == 1, "one unit at a time: a decoder layer's staged parameters"
    assert not stager.missing()
    bad = [n for n in want if not torch.equal(live[n].view(torch.uint8), want[n].view(torch.uint8))]
    assert not bad, f"parameters differ from the loader's view of the checkpoint: {bad[:4]}"


def test_a_landing_order_opening_every_layer_at_once_takes_more_slots_or_is_refused() -> None:
    live, want, committed, units, stager = _sync("v2", trainer="tp=2")
    assert stager.window.layout.slots > 1, "v2 with two trainer ranks sends every layer in each rank's pull"
    assert sorted(committed) == sorted(units)
    assert all(torch.equal(live[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
    one = stager.window.layout.slot_bytes
    with pytest.raises(KvmoveError, match=r"needs 5 slot\(s\) .* over the staging budget .* \(v3\)"):
        _sync("v2", trainer="tp=2", budget=one)
