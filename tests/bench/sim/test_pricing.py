"""Predictions respect their speed of light and move the right way with bytes, replicas and link speed."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvmove.bench.sim.costs import default_book
from kvmove.bench.sim.fractions import parse_fractions
from kvmove.bench.sim.hardware import Cluster
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.setup import CONSTRAINTS, PUBLISHED, SimSetup, TrainerSpec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout

BOOK = default_book()
ALL = list(SIM_STRATEGIES.values())


def _qwen(layers: int = 4, **kw: object) -> SimSetup:
    cfg = resolve_model("qwen3-235b-a22b", {"num_hidden_layers": layers})
    base = dict(trainer_nodes=2, engine_nodes=2, cluster=Cluster())
    base.update(kw)
    trainer = base.pop("trainer", TrainerSpec.parse("tp=4,pp=2,ep=8"))
    engine = base.pop("engine", EngineLayout.parse("dp=16,ep=16"))
    return SimSetup(cfg, trainer, engine, **base)  # type: ignore[arg-type]


def _grid() -> list[SimSetup]:
    out = []
    for transport, dtype, quant, direct, fanout in itertools.product(
        ("pull", "push", "nccl"), ("bf16", "fp8"), ("engine", "trainer"), (False, True), ("none", "tree")
    ):
        if dtype == "bf16" and quant == "trainer":
            continue
        engine = EngineLayout.parse("tp=8,ep=8", 2)
        out.append(_qwen(transport=transport, dtype=dtype, quantize_on=quant, direct=direct, fanout=fanout,
                         engine=engine))  # fmt: skip
    out.append(_qwen(constraints=PUBLISHED))
    out.append(_qwen(trainer=TrainerSpec.parse("fsdp:world=16,shard=8"), engine=EngineLayout.parse("tp=8", 2)))
    out.append(_qwen(trainer=TrainerSpec.parse("host:world=16"), engine=EngineLayout.parse("tp=8", 2),
                     placement="colocated"))  # fmt: skip
    out.append(_qwen(trainer=TrainerSpec.parse("tp=4,pp=2,ep=8,dp=2"), engine=EngineLayout.parse("tp=8", 2),
                     placement="colocated", transport="cuda-ipc"))  # fmt: skip
    # mapped pulls where an engine rank shares a GPU with a trainer rank holding its slice
    out.append(_qwen(trainer=TrainerSpec.parse("tp=4,pp=2,ep=8,dp=2"), engine=EngineLayout.parse("tp=8,ep=8", 2),
                     placement="colocated", transport="cuda-ipc", dtype="fp8", quantize_on="trainer",
                     direct=True))  # fmt: skip
    out.append(_qwen(cluster=Cluster.parse("gpu=b200,nic=cx8-800"), cold=True))
    out.append(_qwen(cluster=Cluster.parse("gpu=h20,nic=cx7-200,nics_per_node=4"), via_host=True))
    out.append(_qwen(transport="nccl", bucket_bytes=1 << 28, constraints=CONSTRAINTS["sglang"], ep_gather=True))
    out.append(_qwen(trainer=TrainerSpec.parse("host:world=16"), engine=EngineLayout.parse("tp=8", 2),
                     placement="colocated", bucket_bytes=1 << 30, remote_host=True))  # fmt: skip
    out.append(_qwen(delta=parse_fractions("experts=0.02,attention=0.01"), fanout="tree",
                     engine=EngineLayout.parse("tp=8,ep=8", 2)))  # fmt: skip
    return out


@pytest.mark.parametrize("setup", _grid(), ids=lambda s: s.label()[:90])
def test_no_prediction_beats_its_speed_of_light(setup: SimSetup) -> None:
    for p in simulate(setup, ALL, BOOK):
        assert p.seconds >= p.speed_of_light_seconds * (1 - 1e-9) > 0, p
        assert p.seconds >= p.receiver_bound_seconds * (1 - 1e-9), p
        assert p.speed_of_light_seconds >= p.receiver_bound_seconds * (1 - 1e-9) or p.strategy == "v1"
        assert all(v >= 0 for v in p.phases.values())
        assert p.bytes_moved >= p.bytes_kept > 0


def test_efficiency_of_one_reaches_the_speed_of_light_only_without_overheads() -> None:
    """With every efficiency 1 and every overhead 0, v2's transfer is its line-rate bound (nothing is faster)."""
    book = BOOK.with_values({n: 1.0 for n, c in BOOK.costs.items() if c.unit == "fraction"}, "test")
    book = book.with_values({n: 0.0 for n, c in BOOK.costs.items() if c.unit != "fraction"}, "test")
    s = _qwen(direct=True)
    (p,) = simulate(s, [SIM_STRATEGIES["v2"]], book)
    assert p.phases["transfer"] == pytest.approx(p.speed_of_light_seconds, rel=1e-6)
    assert p.seconds >= p.speed_of_light_seconds


@pytest.mark.parametrize("strategy", list(SIM_STRATEGIES))
def test_monotonic_in_bytes_replicas_and_link_speed(strategy: str) -> None:
    st = [SIM_STRATEGIES[strategy]]
    times = [simulate(_qwen(layers), st, BOOK)[0].seconds for layers in (2, 4, 8)]
    assert times == sorted(times) and times[0] < times[-1]
    engine = EngineLayout.parse("tp=8,ep=8")
    for fanout in ("none", "chain", "tree"):
        by_r = []
        for r in (1, 2, 4, 8):
            if r == 1 and fanout != "none":
                continue
            s = _qwen(engine=dataclasses.replace(engine, replicas=r), engine_nodes=r, fanout=fanout)
            by_r.append(simulate(s, st, BOOK)[0].seconds)
        assert by_r == sorted(by_r), (fanout, by_r)
    for key in ("nic_gbps", "nvlink_gbps", "hbm_gbps", "pcie_gbps"):
        by_link = [simulate(_qwen(cluster=Cluster.parse(f"gpu=h100,{key}={v}")), st, BOOK)[0].seconds
                   for v in (100, 400, 1600)]  # fmt: skip
        assert by_link == sorted(by_link, reverse=True), (key, by_link)


def test_relays_take_the_load_off_the_trainer_with_many_replicas() -> None:
    """With one trainer node and 16 replicas, the trainer's NICs bind direct fan-out; a tree relays instead."""
    s = _qwen(layers=8, trainer=TrainerSpec.parse("tp=4,pp=1,ep=8"), trainer_nodes=1,
              engine=EngineLayout.parse("tp=8,ep=8", 16), engine_nodes=16)  # fmt: skip
    direct, tree = (
        simulate(dataclasses.replace(s, fanout=f), [SIM_STRATEGIES["v3"]], BOOK)[0] for f in ("none", "tree")
    )
    assert "trainer" in direct.binding_link and tree.seconds < direct.seconds / 2


def test_costs_move_the_prediction_the_right_way() -> None:
    s, st = _qwen(), [SIM_STRATEGIES["v3"]]
    base = simulate(s, st, BOOK)[0].seconds
    assert simulate(s, st, BOOK.with_values({"pull_efficiency": 0.4}, "t"))[0].seconds > base
    assert simulate(s, st, BOOK.with_values({"request_s": 1e-2}, "t"))[0].seconds > base


def test_bad_setups_are_one_clear_error() -> None:
    with pytest.raises(KvmoveError, match="colocated placement puts engine ranks"):
        _qwen(engine=EngineLayout.parse("tp=8", 3), engine_nodes=3, placement="colocated")
    with pytest.raises(KvmoveError, match="needs --replicas >= 2"):
        _qwen(fanout="chain")
    with pytest.raises(KvmoveError, match="cuda-ipc reaches GPUs of one node"):
        _qwen(transport="cuda-ipc")
    with pytest.raises(KvmoveError, match="trainer needs 16 GPUs"):
        _qwen(trainer_nodes=1)
    with pytest.raises(KvmoveError, match="transport 'rdma' is not one of"):
        _qwen(transport="rdma")
    with pytest.raises(KvmoveError, match="direct pulls read Megatron shards"):
        _qwen(trainer=TrainerSpec.parse("fsdp:world=16,shard=8"), direct=True)
    with pytest.raises(KvmoveError, match=r"shard \(8\) must divide world \(12\)"):
        TrainerSpec.parse("fsdp:world=12,shard=8")


def test_bucketed_broadcasts_pay_per_bucket_and_an_engine_taking_one_update_serializes_stages() -> None:
    st = [SIM_STRATEGIES["broadcast"]]
    per_tensor = simulate(_qwen(transport="nccl"), st, BOOK)[0]
    book = BOOK.with_values({"broadcast_op_s": 0.01}, "t")
    small, large = (simulate(_qwen(transport="nccl", bucket_bytes=b), st, book)[0] for b in (1 << 28, 1 << 31))
    assert small.seconds > large.seconds  # one call per bucket
    assert per_tensor.bytes_moved == small.bytes_moved == large.bytes_moved
    waits = simulate(_qwen(transport="nccl", bucket_bytes=1 << 28, bucket_call="async"), st, book)[0]
    assert waits.seconds < small.seconds  # calls dispatched and awaited once: none on the path
    v3 = [SIM_STRATEGIES["v3"]]
    free = simulate(_qwen(), v3, BOOK)[0]
    one = simulate(_qwen(constraints=CONSTRAINTS["sglang"]), v3, BOOK)[0]
    assert one.seconds > free.seconds and one.seconds >= one.phases["transfer"] + one.phases["load"] - 1e-9
    with pytest.raises(KvmoveError, match="bucket_call 'rpc' is not one of"):
        _qwen(bucket_call="rpc")


def test_a_hosts_broadcasts_take_gloos_rounds_and_nccl_calls_one() -> None:
    """gloo between CPU processes: a ring all-gather over n takes n - 1 steps, a binomial-tree broadcast to n
    members ceil(log2 n), its root sending once per step; an NCCL call is one. kvmove's broadcast on a host: every
    tensor's call to trainer rank 0 and the 4 engine ranks is 3 steps, and each gather onto rank 0 its steps."""
    from kvmove.bench.sim.hardware import rounds
    from kvmove.bench.sim.models import sim_model

    host = Cluster.parse("gpu=cpu,nvlink_gbps=3.5,hbm_gbps=7,pcie_gbps=3.5,gpus_per_node=4,nics_per_node=1")
    assert host.host and not Cluster().host
    assert [rounds(host, n) for n in (2, 4, -2, -5, -9)] == [1, 3, 1, 3, 4]
    assert [rounds(Cluster(), n) for n in (2, 4, -2, -5)] == [1, 1, 1, 1]
    s = SimSetup(sim_model("qwen3-moe-tiny"), TrainerSpec.parse("tp=2,pp=2,ep=2"), EngineLayout.parse("tp=2,ep=2", 2),
                 host, 1, 1, placement="colocated", transport="nccl")  # fmt: skip
    bcast = [SIM_STRATEGIES["broadcast"]]
    free = BOOK.with_values({"broadcast_op_s": 0.0}, "t")
    extra = simulate(s, bcast, BOOK.with_values({"broadcast_op_s": 1e-3}, "t"))[0].seconds
    extra -= simulate(s, bcast, free)[0].seconds
    # 113 tensors x 3 steps to the engines; 21 all-gathers over 2 and 80 tensors brought to rank 0, 1 step each
    assert extra == pytest.approx(1e-3 * (113 * 3 + 21 + 80))


def test_an_engines_own_loader_scans_its_expert_mapping_per_tensor() -> None:
    """Where the engine lands weights through its own loader, each tensor costs the loader's call and a scan of
    the expert mapping, 1.5 entries per routed expert (``kvmove.bench.sim.costs.expert_scan``)."""
    from kvmove.bench.sim.builder import build_traffic

    setup = _qwen(engine=EngineLayout.parse("tp=8"), constraints=CONSTRAINTS["vllm-ipc"])
    v2 = SIM_STRATEGIES["v2"]
    tensors = build_traffic(setup, v2).total("engine", "regions").max()  # every rank loads every tensor (TP)
    (scanning,) = simulate(setup, [v2], BOOK)
    (blind,) = simulate(setup, [v2], BOOK.with_values({"loader_scan_s": 0.0}, "test"))
    scan = scanning.phases["load"] - blind.phases["load"]
    assert scan == pytest.approx(tensors * 1.5 * 128 * BOOK["loader_scan_s"])
    assert scan > 0.05 * scanning.phases["load"]
