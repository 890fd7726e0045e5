"""Mapped pulls (pure planning): with a transport that maps a peer's buffers, an engine rank on a trainer rank's
device quantizes the covers that rank would have packed, straight from its arena; nowhere else."""

from __future__ import annotations

import pytest

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.dryrun import build_plans
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.direct import arena_layouts
from kvmove.sync.planning.entries import TRAINER, mappable
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.strategies import parse_strategies

CASES = [("qwen3-moe-fp8-tiny", "tp=1", "tp=1"), ("deepseek-v3-fp8-tiny", "tp=2,ep=2", "tp=2,ep=2")]


def _blueprint(model: str, trainer: str, engine: str, placement: Placement, mapped: bool) -> Blueprint:
    config = SyncConfig(
        resolve_model(model),
        TrainerLayout.parse(trainer),
        EngineLayout.parse(engine),
        tuple(parse_strategies("v1,v3")),
        placement=placement,
    )
    plans, _ = build_plans(config)
    devices = DeviceMap.of(placement, config.trainer.world, config.engine.world)
    return Blueprint(
        config.model, config.trainer, config.engine, plans, config.strategies, config.options,
        devices=devices, mapped=mapped,
    )  # fmt: skip


@pytest.mark.parametrize(("model", "trainer", "engine"), CASES)
def test_covers_in_a_local_raw_shard_are_quantized_by_the_engine_from_the_arena(
    model: str, trainer: str, engine: str
) -> None:
    bp = _blueprint(model, trainer, engine, Placement("processes", colocated=True), mapped=True)
    arenas = arena_layouts(Ownership(bp.cfg, bp.trainer), hf_tensors(bp.cfg))
    for pp in bp.pulls["v3"]:
        assert pp.plan is not None
        mapped = [p for p in pp.pulls if p.mapped]
        assert mapped, "every FP8 cover here lies in one raw shard of the colocated trainer rank"
        for p in mapped:
            assert p.trainer == pp.engine % bp.trainer.world and not p.direct
            assert p.entries == tuple(m.entry for m in p.mapped)
            assert p.nbytes == sum(pp.plan.entries[k].nbytes for k in p.entries)  # the FP8 bytes it lands
            for m in p.mapped:
                entry = pp.plan.entries[m.entry]
                assert mappable(entry) and m.shard.contains(entry.box)
                arena = arenas[p.trainer]
                assert (m.offset, m.shard) == (arena.offsets[entry.tensor], arena.boxes[entry.tensor])
        packed = [pp.plan.entries[k] for p in pp.pulls if p.packed for k in p.entries]
        assert not any(mappable(e) for e in packed)  # nothing the engine can quantize is left to the slot path
    assert bp.mapped_bytes("v3") == sum(p.nbytes for pp in bp.pulls["v3"] for p in pp.pulls if p.mapped) > 0
    assert bp.mapped_bytes("v1") == 0  # v1 gathers every tensor it serves: no cover is read from a raw shard
    for e in range(bp.engine.world):  # and no trainer rank packs any of them
        served = [s for specs in bp.specs("v3", e).values() for _, ss in specs.values() for s in ss]
        assert not any(s.transform == TRAINER and s.shard for s in served)


@pytest.mark.parametrize(
    ("placement", "mapped"),
    [
        (Placement("processes"), True),  # CPU ranks of their own: no shared device, so nothing to map locally
        (Placement("processes", colocated=True), False),  # a transport without a mapped peer view
    ],
)
def test_without_a_local_mapped_arena_covers_stay_packed(placement: Placement, mapped: bool) -> None:
    bp = _blueprint("qwen3-moe-fp8-tiny", "tp=1", "tp=1", placement, mapped)
    assert bp.mapped_bytes("v3") == 0 and not any(p.mapped for pp in bp.pulls["v3"] for p in pp.pulls)
    assert any(e.transform == TRAINER for pp in bp.pulls["v3"] for e in pp.plan.entries)  # type: ignore[union-attr]
