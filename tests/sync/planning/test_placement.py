"""Placement (which ranks share a device), routing's preference for reads that stay on a device, a region read in
pieces along the raw shards, and a sync's ceiling from its bytes by device and link (pure planning)."""

from __future__ import annotations

import pytest

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncOptions
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.ceiling import LinkBytes, ceiling_seconds, link_bytes
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.plan import plan_engine
from kvmove.sync.strategies import parse_strategies


def test_device_keys_of_each_placement() -> None:
    assert DeviceMap.of(Placement("processes"), 2, 2) == (("cpu:t0", "cpu:t1"), ("cpu:e0", "cpu:e1"))
    coloc = DeviceMap.of(Placement("processes", colocated=True), 2, 4)  # the CPU twin: engine e on trainer e % 2
    assert coloc == (("cpu#0", "cpu#1"), ("cpu#0", "cpu#1", "cpu#0", "cpu#1"))
    assert coloc.is_local(2, 0) and not coloc.is_local(2, 1)
    one_gpu = DeviceMap.of(Placement("processes", ("cuda:0",), colocated=True), 2, 2)
    assert set(one_gpu.trainer + one_gpu.engine) == {"cuda:0"}
    two = DeviceMap.of(Placement("processes", ("cuda:0", "cuda:1"), colocated=True), 2, 2)
    assert two.engine == ("cuda:0", "cuda:1") and two.shared() == {"cuda:0": ([0], [0]), "cuda:1": ([1], [1])}
    apart = DeviceMap.of(Placement("processes", ("cuda:0",), ("cuda:1",)), 1, 1)
    assert apart == (("cuda:0",), ("cuda:1",)) and not apart.shared()


def _blueprint(trainer: str, engine: str, replicas: int, colocated: bool, strided: bool) -> Blueprint:
    cfg = resolve_model("qwen3-moe-tiny")
    tl, el = TrainerLayout.parse(trainer), EngineLayout.parse(engine, replicas)
    devices = DeviceMap.of(Placement("processes", colocated=colocated), tl.world, el.world)
    plans = plan_engine(cfg, el)
    return Blueprint(cfg, tl, el, plans, parse_strategies("v1,v2,v3"), SyncOptions(), devices=devices, strided=strided)


def test_colocated_routing_keeps_same_layout_bytes_on_their_device() -> None:
    apart = _blueprint("tp=2,ep=2", "tp=2,ep=2", 1, colocated=False, strided=True).link_bytes("v3")
    coloc = _blueprint("tp=2,ep=2", "tp=2,ep=2", 1, colocated=True, strided=True).link_bytes("v3")
    assert apart is not None and coloc is not None
    assert apart.as_json()["local_bytes"] == 0 and apart.total == coloc.total
    assert coloc.as_json()["cross_bytes"] == 0  # engine rank i reads only trainer rank i, on its own device


@pytest.mark.parametrize(("trainer", "engine", "replicas"), [("pp=2", "tp=2", 1), ("tp=2,ep=2", "tp=1", 2)])
def test_2d_copies_let_resharded_regions_be_read_directly_in_pieces(trainer: str, engine: str, replicas: int) -> None:
    rows = _blueprint(trainer, engine, replicas, colocated=True, strided=False)
    copies = _blueprint(trainer, engine, replicas, colocated=True, strided=True)
    total = sum(pp.nbytes for pp in copies.plans) * replicas
    assert rows.packed_bytes("v3") > 0  # a split the other way is one span per row: packed without 2-D copies
    assert copies.packed_bytes("v3") == 0 and copies.direct_bytes("v3") == total
    for pp in copies.pulls["v3"]:  # every byte of every engine rank still pulled exactly once
        plan = copies.plans[copies.engine.coord(pp.engine).local]
        assert sum(p.nbytes for p in pp.pulls) == plan.nbytes
        for p in pp.pulls:
            for _, runs in p.direct:
                assert (runs[:, 2] > 0).all()
    split = copies.link_bytes("v3")
    assert split is not None and split.total == total and split.as_json()["local_bytes"] > 0


def test_ceiling_counts_the_busiest_device_and_link_direction_once() -> None:
    split = LinkBytes({"cuda:0": 4e9, "cuda:1": 2e9}, {("cuda:0", "cuda:1"): 3e9, ("cuda:1", "cuda:0"): 1e9})
    assert split.local_max == 4e9 and split.cross_max == 3e9
    assert ceiling_seconds(split, copy_gbps=2000, link_gbps=300) == pytest.approx(4e9 / 2e12 + 3e9 / 3e11)
    assert ceiling_seconds(LinkBytes({}, {}), 2000, 300) == 0.0
    bp = _blueprint("tp=2,ep=2", "tp=1", 2, colocated=True, strided=True)
    one = link_bytes(bp.pulls["v3"], bp.devices, engines=[0])  # type: ignore[arg-type]
    assert one.total == bp.plans[0].nbytes


def test_fp8_entries_route_with_pieces_and_devices() -> None:
    """An FP8 engine's plan under colocated, 2-D-copy routing: plain regions spanning raw shards are read directly
    in pieces, quantized covers (and their engine-side pieces) are packed whole, and every entry's bytes are
    pulled exactly once."""
    from kvmove.models.checkpoint import with_engine_dtype

    cfg = with_engine_dtype(resolve_model("qwen3-moe-fp8-tiny"), "fp8")
    tl, el = TrainerLayout.parse("tp=2,ep=2"), EngineLayout.parse("tp=1", 2)
    devices = DeviceMap.of(Placement("processes", colocated=True), tl.world, el.world)
    plans = plan_engine(cfg, el)
    bp = Blueprint(cfg, tl, el, plans, parse_strategies("v1,v3"), SyncOptions(), devices=devices, strided=True)
    pieced = 0
    for pp in bp.pulls["v3"]:
        assert pp.plan is not None
        entries = pp.plan.entries
        assert sum(p.nbytes for p in pp.pulls) == pp.plan.nbytes
        for p in pp.pulls:
            assert all(entries[i].transform == "plain" for i in p.entries) if p.direct else True
        pieced += sum(1 for e in entries if e.pieces)
        assert all(not e.pieces for e in entries if e.transform != "plain")
        assert {e.transform for e in entries} >= {"plain", "trainer"}
    assert pieced > 0  # the embedding (vocab split on the trainer) is read in pieces
    assert bp.direct_bytes("v3") > 0 and bp.packed_bytes("v3") > 0
    split = bp.link_bytes("v3")
    assert split is not None and split.total == sum(pp.plan.nbytes for pp in bp.pulls["v3"] if pp.plan)
    assert bp.direct_bytes("v1") == 0  # v1 gathers: covers quantized on the trainer after the gather
