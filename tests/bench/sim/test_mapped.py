"""Mapped pulls in the simulator (``kvmove.bench.sim.mapped``): a colocated cuda-ipc FP8 sync is priced as the
planner plans it (the engine quantizes straight from the trainer's arena, nothing packed, sent or landed), and
nothing else is."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvmove.bench.sim.builder import build_traffic
from kvmove.bench.sim.costs import default_book
from kvmove.bench.sim.hardware import Cluster
from kvmove.bench.sim.mapped import Mapper, ahead_seconds, device_map, entry, floor_seconds, maps_peers
from kvmove.bench.sim.ownruns import ONE_GPU_CLUSTER
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.setup import SimSetup, Spec, TrainerSpec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.dryrun import build_plans
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.strategies import parse_strategies

BOOK = default_book()
V2, V3 = SIM_STRATEGIES["v2"], SIM_STRATEGIES["v3"]


def _slice(**kw: object) -> SimSetup:
    """The gpu-fp8 suite's sync (Qwen3-235B-A22B, trainer and engine tp=1 on one H200, cuda-ipc, direct, FP8
    quantized on the trainer), on a 2-layer slice."""
    spec = Spec(
        "qwen3-235b-a22b", "tp=1", "tp=1", 1, 1, 1, ONE_GPU_CLUSTER, "colocated", "cuda-ipc", dtype="fp8",
        quantize_on="trainer", direct=True, overrides=("num_hidden_layers=2",),
    )  # fmt: skip
    return dataclasses.replace(spec, **kw).build()  # type: ignore[arg-type]


def _total(s: SimSetup, side: str, key: str, strategy: object = V3) -> float:
    return float(build_traffic(s, strategy).total(side, key).sum())  # type: ignore[arg-type]


def test_a_colocated_cuda_ipc_fp8_v3_sync_is_priced_with_mapped_pulls() -> None:
    s = _slice()
    t = build_traffic(s, V3)
    mapped = float(t.total("engine", "mapped").sum())
    assert mapped > 0
    for key in ("quant", "pack", "yield"):  # the trainer neither gathers, packs nor quantizes a byte
        assert not t.total("trainer", key).any(), key
    assert not t.gather
    recv, kept = float(t.total("engine", "recv").sum()), float(t.total("engine", "kept").sum())
    assert recv == float(t.total("trainer", "send").sum())  # only the direct reads cross the device copy
    assert 0 < recv < kept and not t.total("engine", "scatter").any()  # nothing lands from a receive slot
    (p,) = simulate(s, [V3], BOOK)
    quantize = float(BOOK.quantize_seconds(mapped, s.cluster.hbm_rate))
    assert ahead_seconds(t, s, BOOK) == pytest.approx(quantize)
    assert p.seconds >= quantize and p.phases["load"] >= quantize  # started ahead, on a stream of their own
    assert p.seconds >= p.speed_of_light_seconds >= floor_seconds(t, s) > 0
    assert p.bytes_moved == pytest.approx(kept)  # landed from the arena or read directly, as the executors count


def test_a_disaggregated_fp8_sync_packs_what_a_colocated_one_maps() -> None:
    mapped = _total(_slice(), "engine", "mapped")
    apart = _slice(placement="disaggregated", transport="pull", cluster="gpu=h200,nic=cx7-400")  # cuda-ipc: one node
    assert _total(apart, "engine", "mapped") == 0
    assert _total(apart, "trainer", "quant") == pytest.approx(mapped)  # the trainer quantizes them into slots
    (mapped_p,), (packed_p,) = simulate(_slice(), [V3], BOOK), simulate(apart, [V3], BOOK)
    assert mapped_p.phases["pack"] == 0 < packed_p.phases["pack"]


@pytest.mark.parametrize(
    "change",
    [
        {"direct": False},  # v3 without direct pulls gathers every tensor it serves: no cover read from a raw shard
        {"transport": "nccl"},  # a transport without a mapped peer view
        {"transport": "pull"},
        {"quantize_on": "engine"},  # BF16 travels; the engine quantizes what it received
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_nothing_is_mapped_where_the_planner_maps_nothing(change: dict[str, object]) -> None:
    s = _slice(**change)
    assert _total(s, "engine", "mapped") == 0
    (p,) = simulate(s, [V3], BOOK)
    assert p.binding_link != "HBM (mapped quantization)"


def test_without_direct_ahead_each_mapped_pull_is_quantized_in_its_turn() -> None:
    s = _slice()
    t = build_traffic(s, V2)
    assert not V2.ahead and V3.ahead and ahead_seconds(t, s, BOOK) == 0
    mapped = float(t.total("engine", "mapped").sum())
    (p,) = simulate(s, [V2], BOOK)
    assert p.phases["load"] >= float(BOOK.quantize_seconds(mapped, s.cluster.hbm_rate)) > 0


def test_the_rules_are_the_planners() -> None:
    assert maps_peers("cuda-ipc") and not maps_peers("nccl") and not maps_peers("pull")
    assert device_map(_slice()).is_local(0, 0)
    cfg = resolve_model("qwen3-235b-a22b", {"num_hidden_layers": 2})
    trainer, engine = TrainerSpec.parse("tp=2,dp=2"), EngineLayout.parse("tp=4")
    together = SimSetup(cfg, trainer, engine, Cluster(), placement="colocated")
    devices = device_map(together)
    assert [devices.is_local(e, t) for e, t in ((0, 0), (3, 3), (0, 1))] == [True, True, False]
    apart = device_map(dataclasses.replace(together, placement="disaggregated"))
    assert not any(apart.is_local(e, t) for e in range(4) for t in range(4))
    mapper = Mapper(dataclasses.replace(together, transport="cuda-ipc"))
    keepers, holders = np.arange(4), lambda i: np.array([i])
    name = "model.layers.0.self_attn.q_proj.weight"
    assert mapper.mapped(entry(name, (8, 8), True, True), keepers, holders).all()
    assert not mapper.mapped(entry(name, (8, 8), False, True), keepers, holders).any()  # a plain region
    assert not mapper.mapped(entry(name, (8, 8), True, False), keepers, holders).any()  # after the gather
    assert not mapper.mapped(entry(name, (8, 8), True, True), keepers, lambda i: np.array([(i + 1) % 4])).any()


@pytest.mark.parametrize(
    ("model", "trainer", "engine", "cluster"),
    [
        ("qwen3-moe-fp8-tiny", "tp=1", "tp=1", ONE_GPU_CLUSTER),
        ("deepseek-v3-fp8-tiny", "tp=2,ep=2", "tp=2,ep=2", "gpu=h200,nic=cx7-400"),
    ],
)
def test_the_simulators_mapped_bytes_are_the_planners(model: str, trainer: str, engine: str, cluster: str) -> None:
    """Per engine rank, the FP8 bytes the planner's mapped pulls land (``Blueprint(mapped=True)``, colocated
    ranks) are the bytes the simulator has that rank keep without receiving them."""
    placement = Placement("processes", colocated=True)
    config = SyncConfig(
        resolve_model(model), TrainerLayout.parse(trainer), EngineLayout.parse(engine),
        tuple(parse_strategies("v3")), placement=placement,
    )  # fmt: skip
    plans, _ = build_plans(config)
    devices = DeviceMap.of(placement, config.trainer.world, config.engine.world)
    bp = Blueprint(config.model, config.trainer, config.engine, plans, config.strategies, config.options,
                   devices=devices, mapped=True)  # fmt: skip
    planned = [sum(p.nbytes for p in pp.pulls if p.mapped) for pp in bp.pulls["v3"]]
    s = Spec(model, trainer, engine, 1, 1, 1, cluster, "colocated", "cuda-ipc", dtype="fp8", quantize_on="trainer",
             direct=True).build()  # fmt: skip
    t = build_traffic(s, V3)
    assert any(planned) and list(t.total("engine", "kept") - t.total("engine", "recv")) == planned


def test_a_mapped_fp8_row_sets_the_quantize_rate_that_prices_it_back_to_its_own_seconds(tmp_path) -> None:
    """One GPU, FP8 v3 with mapped pulls: the sync is bounded by the engine's quantize programs, so the row's
    seconds (less the direct BF16 row's fixed cost) give the quantize rate, and that book predicts the row."""
    from kvmove.bench.results import Labels, Row, append_rows, load_results
    from kvmove.bench.sim.measure import costs_from_rows
    from kvmove.bench.sim.ownruns import one_gpu_book

    def row(dtype: str, seconds: float, transfer: float, executors: dict[str, int]) -> Row:
        return Row(kind="measured", suite="gpu", name=f"fp8 sync v3 {dtype}", model="qwen3-235b-a22b",
                   trainer="tp=1,pp=1,ep=1,etp=1,dp=1", engine="tp=1,dp=1,ep=1,pp=1 x1", strategy="v3",
                   transport="cuda-ipc", bytes=sum(executors.values()), seconds=seconds,
                   phases={"transfer": transfer, "load": seconds - transfer},
                   extra={"sync": 2, "verified": True, "direct": True, "engine_dtype": dtype,
                          "trainer_devices": ["cuda:0"], "engine_devices": ["cuda:0"],
                          "transfer_gbps": 1000.0, "copy_executor_bytes": executors,
                          "model_overrides": {"num_hidden_layers": 2}})  # fmt: skip

    bf16 = row("bf16", 0.0070, 0.0060, {"driver": 10**10})
    fp8 = row("fp8", 0.0080, 0.0020, {"driver": 2 * 10**9, "mapped-quantize": 5 * 10**9})
    append_rows(tmp_path, "gpu", [bf16, fp8], Labels("gpu:H200 x1", {}, "m"))
    rows = load_results(tmp_path)
    book = costs_from_rows(rows, "one-gpu")
    quantize, fixed = book.costs["quantize_efficiency"], book.costs["sync_s"]
    assert quantize.kind == "derived" and [r.commit for r in quantize.rows] == ["m"]
    assert fixed.kind == "derived" and fixed.value == pytest.approx(0.0010)
    bf16_bytes = float(build_traffic(_slice(), V3).total("engine", "mapped").max())
    assert quantize.value == pytest.approx(1.5 * bf16_bytes / 0.0070 / 4800e9)
    (p,) = simulate(_slice(), [V3], one_gpu_book(rows))
    assert p.seconds == pytest.approx(0.0080, rel=1e-6)
