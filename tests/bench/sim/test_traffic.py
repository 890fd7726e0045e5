"""The simulator's traffic against the real sharding plans (bytes per sync, per engine rank, per trainer rank)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from kvmove.bench.sim.builder import build_traffic
from kvmove.bench.sim.groups import units
from kvmove.bench.sim.hardware import Cluster
from kvmove.bench.sim.models import sim_model
from kvmove.bench.sim.setup import SimSetup, TrainerSpec
from kvmove.bench.sim.shards import wire_bytes
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.cli.main import app
from kvmove.errors import LayoutError
from kvmove.models import model_totals, resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors


def _setup(model: str, trainer: str, engine: str, replicas: int = 1, **kw: object) -> SimSetup:
    return SimSetup(
        sim_model(model), TrainerSpec.parse(trainer), EngineLayout.parse(engine, replicas), Cluster(), 64, 64, **kw
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "trainer", "engine", "replicas", "expected"),
    [
        ("qwen3-235b-a22b", "tp=4,pp=2,ep=8", "dp=16,ep=16", 1, 710_104_432_640),
        ("kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32", 4, 8_481_498_595_328),
    ],
)
def test_published_layouts_move_the_plans_bytes(model, trainer, engine, replicas, expected) -> None:
    """The bytes the real plans of these layouts keep (kvmove.sync.planning.plan; 8,481,498,595,328 = Kimi's 7.9 TB)."""
    s = _setup(model, trainer, engine, replicas)
    for name in ("v1", "v2", "v3"):
        t = build_traffic(s, SIM_STRATEGIES[name])
        assert round(t.kept_per_replica * replicas) == expected
        assert round(t.received_per_replica * replicas) == expected
    b = build_traffic(s, SIM_STRATEGIES["broadcast"])
    assert round(b.received_per_replica) == model_totals(s.model).total_bytes * s.engine.ranks_per_replica


LAYOUTS = [
    ("qwen3-moe-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2", 2),
    ("qwen3-moe-tiny", "tp=1,pp=2,ep=4", "tp=4", 1),
    ("qwen3-moe-tiny", "tp=2,pp=1,ep=2,etp=2", "dp=2,ep=2", 1),
    ("kimi-k2-tiny", "tp=2,pp=3,ep=4", "tp=4,ep=4", 1),
    ("kimi-k2-tiny", "tp=1,pp=1,ep=2", "tp=1,dp=2,ep=2,pp=1", 2),
]


@pytest.mark.parametrize(("model", "trainer", "engine", "replicas"), LAYOUTS)
def test_bytes_per_rank_equal_the_dry_run_of_the_real_plans(model, trainer, engine, replicas) -> None:
    """`kvmove sync-weights --dry-run --json` (the real recording-tensor plans and router) against the traffic."""
    args = ["sync-weights", "--dry-run", "--json", "--model", model, "--trainer", trainer, "--engine", engine]
    out = CliRunner().invoke(app, [*args, "--replicas", str(replicas), "--strategy", "v1,v2,v3"])
    assert out.exit_code == 0, out.output
    reports = {r["strategy"]: r for r in map(json.loads, out.stdout.strip().splitlines())}
    s = SimSetup(
        resolve_model(model), TrainerSpec.parse(trainer), EngineLayout.parse(engine, replicas), Cluster(), 8, 8
    )
    for name, r in reports.items():
        t = build_traffic(s, SIM_STRATEGIES[name])
        whole = t if name != "v1" else build_traffic(s, SIM_STRATEGIES["v2"])  # per-rank totals are layout facts
        assert round(t.kept_per_replica * replicas) == r["bytes_total"]
        assert whole.total("engine", "kept").max() == pytest.approx(r["bytes_per_engine_rank_max"])
        # the router balances bytes greedily; the traffic spreads them evenly: equal up to the plan's imbalance
        busiest = whole.total("trainer", "send").max() * replicas
        assert busiest == pytest.approx(r["bytes_per_trainer_rank_max"], rel=0.35)


def test_fp8_wire_bytes_have_one_fp32_scale_per_block() -> None:
    assert wire_bytes("model.layers.0.mlp.experts.3.down_proj.weight", (7168, 2048), "fp8") == 7168 * 2048 + 4 * 56 * 16
    assert wire_bytes("model.layers.0.mlp.experts.3.down_proj.weight", (7168, 2048), "fp8", 64) == (
        7168 * 2048 + 4 * 112 * 32
    )
    assert (
        wire_bytes("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), "fp8") == 576 * 7168 + 4 * 5 * 56
    )
    for unquantized in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.gate.weight"):
        assert wire_bytes(unquantized, (384, 7168), "fp8") == 2 * 384 * 7168
    s = _setup("kimi-k2", "tp=8,pp=8,ep=32", "tp=16,ep=16", dtype="fp8", quantize_on="trainer")
    fp8 = build_traffic(s, SIM_STRATEGIES["v3"]).kept_per_replica
    # one replica's BF16 bytes (replicated tensors counted on every rank)
    bf16 = build_traffic(_setup("kimi-k2", "tp=8,pp=8,ep=32", "tp=16,ep=16"), SIM_STRATEGIES["v3"]).kept_per_replica
    assert 0.5 * bf16 < fp8 < 0.51 * bf16  # one byte per weight plus 4 bytes per 128x128 block
    s_engine = _setup("kimi-k2", "tp=8,pp=8,ep=32", "tp=16,ep=16", dtype="fp8", quantize_on="engine")
    assert build_traffic(s_engine, SIM_STRATEGIES["v3"]).kept_per_replica == bf16  # BF16 on the wire


def test_an_fp8_engine_layout_that_cuts_a_block_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(LayoutError, match=r"engine tp=32 with FP8 weights: mlp\.gate_up_proj .* 576 per rank"):
        _setup("kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32", dtype="fp8", quantize_on="trainer")
    with pytest.raises(LayoutError, match=r"mlp\.experts intermediate size is 192 per rank"):
        _setup("qwen3-235b-a22b", "tp=4,pp=2,ep=8", "tp=8", dtype="fp8")
    _setup("kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32")  # BF16 weights: any split the layout allows
    _setup("kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32", dtype="fp8", block=64)  # 64 x 64 blocks, as LMSYS states


def test_direct_pulls_skip_gather_and_pack_where_slices_nest() -> None:
    s = _setup("qwen3-235b-a22b", "tp=4,pp=2,ep=8", "tp=4,ep=16,dp=4", direct=True)
    packed = build_traffic(s.__class__(**{**s.__dict__, "direct": False}), SIM_STRATEGIES["v3"])
    direct = build_traffic(s, SIM_STRATEGIES["v3"])
    assert direct.total("trainer", "pack").sum() == 0 and direct.total("engine", "scatter").sum() == 0
    assert packed.total("trainer", "pack").sum() > 0 and packed.gather and not direct.gather
    assert direct.kept_per_replica == packed.kept_per_replica


COARSER = [
    ("qwen3-moe-small", "tp=2,pp=2,ep=2", "tp=1"),
    ("qwen3-moe-small", "tp=4,pp=1,ep=2", "tp=2"),
    ("qwen3-moe-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2"),
    ("kimi-k2-tiny", "tp=2,pp=1,ep=2", "tp=1"),
]


@pytest.mark.parametrize("strided", [False, True], ids=["nixl", "cuda-ipc"])
@pytest.mark.parametrize(("model", "trainer", "engine"), COARSER)
def test_direct_and_packed_bytes_per_engine_rank_are_the_planners(model, trainer, engine, strided) -> None:
    """The planner's direct rule, as the simulator prices it: a slice lying in several trainer shards is read in
    pieces, one too costly to read directly (a row-parallel slice of short rows, without a strided transport) is
    packed, and each engine rank pulls once from every trainer rank serving its direct slices, and its packed ones."""
    from kvmove.sync.config import Placement, SyncConfig
    from kvmove.sync.driver.dryrun import build_plans
    from kvmove.sync.planning.blueprint import Blueprint
    from kvmove.sync.strategies import parse_strategies

    config = SyncConfig(
        resolve_model(model), TrainerLayout.parse(trainer), EngineLayout.parse(engine),
        tuple(parse_strategies("v2")), placement=Placement("processes", colocated=False),
    )  # fmt: skip
    plans, _ = build_plans(config)
    bp = Blueprint(config.model, config.trainer, config.engine, plans, config.strategies, config.options,
                   strided=strided)  # fmt: skip
    pulls = bp.pulls["v2"]
    s = SimSetup(resolve_model(model), TrainerSpec.parse(trainer), EngineLayout.parse(engine), Cluster(), 1, 1,
                 direct=True, transport="cuda-ipc" if strided else "pull", placement="colocated")  # fmt: skip
    t = build_traffic(s, SIM_STRATEGIES["v2"])
    packed = [sum(p.nbytes for p in pp.pulls if p.packed) for pp in pulls]
    assert list(t.total("engine", "scatter")) == packed
    assert list(t.total("engine", "recv") - t.total("engine", "scatter")) == [
        sum(p.nbytes for p in pp.pulls if p.direct) for pp in pulls
    ]
    assert list(t.total("engine", "direct_pulls")) == [sum(1 for p in pp.pulls if p.direct) for pp in pulls]
    assert list(t.total("engine", "pulls") - t.total("engine", "direct_pulls")) == [
        sum(1 for p in pp.pulls if p.packed) for pp in pulls
    ]
    if model == "qwen3-moe-small" and engine == "tp=2":  # 512-byte rows of row-parallel slices: packed on NIXL
        assert (packed[0] > 0) != strided


def test_groups_follow_the_strategy() -> None:
    s = _setup("kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32")
    cfg = s.model
    assert len(units(s, SIM_STRATEGIES["v3"])) == cfg.num_hidden_layers + 2
    assert len(units(s, SIM_STRATEGIES["v2"])) == 8
    reps = units(s, SIM_STRATEGIES["v1"])
    assert sum(u.times for u in reps if u.items) == model_totals(cfg).num_tensors
    assert sum(u.times * u.layers for u in reps) == cfg.num_hidden_layers
    assert math.isclose(sum(u.times for u in reps if u.items and u.items[0].experts), 60 * 384 * 3)


def test_a_bucketing_sender_fills_buckets_with_every_byte_once() -> None:
    """Megatron stages bucket their own tensors (an expert block split to fit); host ranks bucket what each holds,
    as many buckets as their bytes fill (checkpoint-engine), spread over the sync's tensors."""
    cfg = resolve_model("qwen3-235b-a22b", {"num_hidden_layers": 4})
    total = model_totals(cfg).total_bytes
    gib = 1 << 30
    mega = SimSetup(cfg, TrainerSpec.parse("tp=4,pp=2,ep=8"), EngineLayout.parse("tp=8,ep=8"), Cluster(), 2, 1,
                    bucket_bytes=gib)  # fmt: skip
    groups = units(mega, SIM_STRATEGIES["broadcast"])
    sizes = [sum(wire_bytes(i.name, i.shape, "bf16") * i.tensors for i in u.items) for u in groups]
    largest = max(wire_bytes(t.name, t.shape, "bf16") for t in hf_tensors(cfg))  # a tensor goes whole
    assert sum(sizes) == total and max(sizes) <= max(gib, largest) and len(groups) >= total / gib
    assert sum(u.layers for u in groups) == cfg.num_hidden_layers
    host = SimSetup(cfg, TrainerSpec.parse("host:world=8"), EngineLayout.parse("tp=8"), Cluster(), 1, 1,
                    placement="colocated", bucket_bytes=gib)  # fmt: skip
    per_rank = math.ceil(total / 8 / gib)
    assert per_rank * 8 <= len(units(host, SIM_STRATEGIES["broadcast-pipelined"])) <= (per_rank + 1) * 8
    assert units(host, SIM_STRATEGIES["v3"]) == units(dataclasses.replace(host, bucket_bytes=0), SIM_STRATEGIES["v3"])


def test_checkpoints_with_fused_experts_are_refused_in_one_line() -> None:
    """gpt-oss and Llama 4 hold every expert of a layer in one tensor: the simulator does not price its EP split."""
    from kvmove.errors import KvmoveError

    with pytest.raises(KvmoveError, match=r"holds every expert of a layer in one \(model\.layers\.0\.mlp\.experts\."):
        _setup("gpt-oss-tiny", "tp=2,ep=2", "tp=2")


@pytest.mark.parametrize(
    ("model", "trainer"),
    [
        ("qwen3-moe-small", "tp=2,pp=2,ep=2"),
        ("qwen3-moe-tiny", "tp=2,pp=1,ep=2,etp=2"),
        ("kimi-k2-tiny", "tp=2,pp=3,ep=4"),
    ],
)
def test_kvmoves_broadcast_brings_every_tensor_to_rank_0_as_its_source_does(model, trainer) -> None:
    """kvmove's broadcast (``send_all``): each tensor is all-gathered in its group where it is split and, unless
    trainer rank 0 holds it, broadcast from its first holder to rank 0, which sends every tensor; counted here from
    the planner's own ownership (what ``ShardedSource`` gathers), not from the simulator's split rules."""
    from kvmove.sync.planning.formats import get_format

    s = _setup(model, trainer, "tp=2,ep=2")
    t = build_traffic(s, SIM_STRATEGIES["broadcast"])
    fmt = get_format("hf")
    own = fmt.ownership(s.model, s.trainer.layout)
    gathers: dict[int, int] = {}
    to_rank0 = to_rank0_bytes = 0
    for meta in fmt.tensors(s.model, s.trainer.layout):
        holdings = own.slices(meta)
        if tuple(b - a for a, b in zip(holdings[0].box.start, holdings[0].box.stop, strict=True)) != meta.shape:
            n = len(own.gather_group(meta, holdings[0].rank))
            gathers[n] = gathers.get(n, 0) + 1
        if min(h.rank for h in holdings) != 0:
            to_rank0, to_rank0_bytes = to_rank0 + 1, to_rank0_bytes + meta.nbytes
    counted = {n: round(float((ops.max(axis=1) * t.count).sum())) for n, (ops, _) in t.gather.items() if n > 0}
    assert counted == gathers
    ops, nbytes = t.gather.get(-2, (t.count[:, None] * 0, t.count[:, None] * 0))
    assert round(float((ops[:, 0] * t.count).sum())) == to_rank0
    assert round(float((nbytes[:, 0] * t.count).sum())) == to_rank0_bytes
    sent = t.total("trainer", "send")
    assert sent[1:].sum() == 0 and round(sent[0]) == model_totals(s.model).total_bytes
    assert round(t.total("trainer", "yield")[0]) == model_totals(s.model).num_tensors  # rank 0 visits every one


def test_a_frameworks_bucketed_broadcast_sends_from_each_stage_root_after_an_ep_gather() -> None:
    s = _setup("qwen3-moe-tiny", "tp=2,pp=2,ep=2", "tp=2,ep=2", bucket_bytes=1 << 20)
    t = build_traffic(s, SIM_STRATEGIES["broadcast"])
    assert not s.funnel and -2 not in t.gather and 2 in t.gather
    sent = t.total("trainer", "send")
    assert sent[0] > 0 and sent[2] > 0  # each pipeline stage's root (ranks 0 and 2) sends its own tensors
