"""Full-scale weight-sync simulator: real sharding plans and routing on meta tensors, a topology, per-op costs.

Pipeline: :func:`traffic` turns the real plans (``plan_engine``), ownership and routing of one strategy into
per-group byte counts per trainer and engine rank (expensive, cached); :func:`predict` prices them on a
:class:`Topology` with :class:`Costs` under :class:`Constraints` (pure arithmetic, milliseconds).

Units: byte rates are bytes/s inside; the cluster spec follows each link's convention and says so:
``nic_gbps`` is **gigabits**/s per NIC (400 = 400G InfiniBand NDR), ``nvlink_gbps`` and ``pcie_gbps`` are
**gigabytes**/s per GPU per direction (450 = H100 NVLink4). Ranks are placed densely, in rank order,
trainer nodes first and engine nodes after them (no colocation), so Megatron's TP groups stay inside nodes.

Model per group (the unit of gather, transfer and release), phases in this order:
- gather: collectives (launch + ring steps × link latency) + bytes over NVLink (intra-node) or NICs;
- pack: the busiest trainer rank's regions × replay cost + bytes at device-copy speed;
- transfer: the busiest link (each GPU's NIC and each node's NICs, send and receive) at ``nic_efficiency``,
  plus one RPC round; with synchronized replicas, a release barrier RPC more;
- load: the busiest engine rank's regions × copy launch + bytes at device-copy speed, plus the layer-wise
  reload cost per module completed in the group (published engine only).

v1 and broadcast run one tensor per group, phases back to back; v2 one group per pipeline stage, phases back to
back; v3 one group per decoder block, pipelined as a flow shop (bounded by ``lookahead`` on the trainer and
``num_buffers`` ring slots on the engine). Serial PP runs stages one after another; without it, the k-th
groups of all stages run together and share the links.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NamedTuple

import numpy as np

from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import layer_of
from kvmove.sync.ownership import Ownership, shard_rule
from kvmove.sync.plan import plan_engine
from kvmove.sync.routing import route
from kvmove.sync.schedule import SyncOptions, tensor_groups
from kvmove.sync.strategies import STRATEGIES

GB = 1e9
PHASES = ("gather", "pack", "transfer", "load")


@dataclass(frozen=True)
class Topology:
    """A homogeneous GPU cluster. Bandwidth units as in the cluster spec (see module docstring)."""

    gpus_per_node: int = 8
    nic_gbps: float = 400.0
    """Gigabits/s per NIC."""
    nics_per_node: int = 8
    nvlink_gbps: float = 450.0
    """Gigabytes/s per GPU per direction."""
    pcie_gbps: float = 64.0
    """Gigabytes/s per GPU (the GPU-NIC path with GPUDirect RDMA; PCIe Gen5 x16)."""
    nic_latency_us: float = 5.0
    nvlink_latency_us: float = 2.0

    @classmethod
    def parse(cls, text: str) -> Topology:
        """``gpus_per_node=8,nic_gbps=400,nvlink_gbps=450[,nics_per_node=8,pcie_gbps=64,...]``."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise KvmoveError(f"cluster spec {text!r}: {part!r} is not one of {', '.join(known)}=VALUE")
            try:
                value = float(raw)
            except ValueError:
                raise KvmoveError(f"cluster spec {text!r}: {key} must be a number, got {raw!r}") from None
            if value <= 0 or not math.isfinite(value):
                raise KvmoveError(f"cluster spec {text!r}: {key} must be positive")
            values[key] = int(value) if known[key].type in ("int", int) else value
        if "gpus_per_node" in values and "nics_per_node" not in values:
            values["nics_per_node"] = values["gpus_per_node"]
        return cls(**values)

    @property
    def gpu_nic_rate(self) -> float:
        """Bytes/s one GPU can push through the NICs (its share of them, capped by PCIe)."""
        share = self.nic_gbps / 8 * GB * self.nics_per_node / self.gpus_per_node
        return min(share, self.pcie_gbps * GB)

    @property
    def node_nic_rate(self) -> float:
        return self.nics_per_node * self.nic_gbps / 8 * GB

    def label(self) -> str:
        return (
            f"{self.gpus_per_node} GPUs/node, {self.nics_per_node}x{self.nic_gbps:g} Gb/s NICs/node, "
            f"NVLink {self.nvlink_gbps:g} GB/s"
        )


@dataclass(frozen=True)
class Placement:
    """Which node each trainer and engine rank sits on (trainer nodes first, then engine nodes)."""

    trainer_node: tuple[int, ...]
    engine_node: tuple[int, ...]
    nodes: int


def place(
    topology: Topology, trainer: TrainerLayout, engine: EngineLayout, trainer_nodes: int, engine_nodes: int
) -> Placement:
    """Dense placement; a KvmoveError if the nodes cannot hold the ranks."""
    gpn = topology.gpus_per_node
    for who, world, nodes in (("trainer", trainer.world, trainer_nodes), ("engine", engine.world, engine_nodes)):
        if nodes < 1:
            raise KvmoveError(f"{who} nodes must be >= 1, got {nodes}")
        if world > nodes * gpn:
            raise KvmoveError(
                f"{who} layout needs {world} GPUs but {nodes} node(s) x {gpn} GPUs hold only {nodes * gpn}"
            )
    t_nodes = tuple(r // gpn for r in range(trainer.world))
    e_nodes = tuple(trainer_nodes + r // gpn for r in range(engine.world))
    return Placement(t_nodes, e_nodes, trainer_nodes + engine_nodes)


@dataclass(frozen=True)
class Costs:
    """Per-operation costs. Where each value comes from is in :data:`COST_SOURCES` (and in the report)."""

    nic_efficiency: float = 0.85
    nccl_efficiency: float = 0.79
    copy_gbps: float = 2100.0
    op_launch_s: float = 6.5e-6
    replay_region_s: float = 15e-6
    collective_launch_s: float = 10e-6
    rpc_s: float = 20e-6
    iter_resume_s: float = 24e-6
    reload_module_s: float = 0.034
    lookahead: int = 1
    num_buffers: int = 2


COST_SOURCES: dict[str, str] = {
    "nic_efficiency": "fit once to the published V3 figures (Qwen3-235B 3.49 s, Kimi K2 7.53 s): share of NIC line "
    "rate that RDMA pulls reach",
    "nccl_efficiency": "measured on the project's 2x H200: NCCL send/recv 357 GB/s over 450 GB/s NVLink (DESIGN.md)",
    "copy_gbps": "measured on the project's H200: device copy 4.2 TB/s read+write = 2.1 TB/s copied (DESIGN.md)",
    "op_launch_s": "measured on the project's H200: 4096 x 1 MiB copies are launch-bound at ~6.5 us each (DESIGN.md)",
    "replay_region_s": "assumed: a few eager view ops (~2-3 us each) plus one copy launch per region; replaced by "
    "the measured per-region pack time when measured sync rows exist in results/",
    "collective_launch_s": "assumed: NCCL kernel launch and proxy wake-up, ~10 us",
    "rpc_s": "assumed: per-pull request round trip with requests issued ahead of the data (NIXL notification + "
    "RDMA read issue, ~20 us); a blocking ~0.5 ms Ray call per pull would put V1 at 2x its published time",
    "iter_resume_s": "published: iter_groups saves ~0.9 s over ~37k per-tensor resumes (REFERENCE.md) = 24 us each",
    "reload_module_s": "fit once to the published V3 figures: vLLM layer-wise reload per module (buffer allocation, "
    "process_weights_after_loading, group release)",
    "lookahead": "published default gather_lookahead = 1",
    "num_buffers": "published default num_rdt_buffers = 2",
}


@dataclass(frozen=True)
class Constraints:
    """The published engine's limits: switch them on to compare with its figures."""

    serial_pp: bool = False
    """Transfers serialized across trainer PP groups (to avoid OOM in layer-wise reload)."""
    layerwise_reload: bool = False
    """vLLM's layer-wise reload: a fixed cost per module on the engine."""
    synchronized_replicas: bool = False
    """All replicas pull a group in lockstep: a release barrier per group."""

    @property
    def label(self) -> str:
        return "published" if self == PUBLISHED else "kvmove" if self == KVMOVE else "custom"


PUBLISHED = Constraints(serial_pp=True, layerwise_reload=True, synchronized_replicas=True)
KVMOVE = Constraints()


Coo = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Sparse (group, rank, bytes, regions) arrays."""


@dataclass(frozen=True, eq=False)
class Traffic:
    """Who sends what to whom, per sync group, from the real plans and routing (topology-free)."""

    strategy: str
    trainer: TrainerLayout
    engine: EngineLayout
    bytes_total: int
    bytes_kept: int
    group_stage: np.ndarray
    group_modules: np.ndarray
    group_resumes: np.ndarray
    gather: dict[int, tuple[np.ndarray, np.ndarray]]
    """Collective size n -> (ops per group, bytes each rank receives per group)."""
    send: Coo
    """COO (group, trainer rank, bytes, regions)."""
    recv: Coo
    """COO (group, engine rank, bytes, regions)."""

    @property
    def groups(self) -> int:
        return len(self.group_stage)


_TRAFFIC: dict[tuple[Any, ...], Traffic] = {}
_PLANS: dict[tuple[Any, ...], Any] = {}


def _cached(key: tuple[Any, ...], build: Any) -> Any:
    if key not in _PLANS:
        _PLANS[key] = build()
    return _PLANS[key]


def traffic(cfg: ModelConfig, trainer: TrainerLayout, engine: EngineLayout, strategy: str) -> Traffic:
    """Build (once per process) the per-group traffic of ``strategy`` from full-size plans on meta tensors."""
    key = (cfg, trainer, engine, strategy)
    if key not in _TRAFFIC:
        _TRAFFIC[key] = _build_traffic(cfg, trainer, engine, strategy)
    return _TRAFFIC[key]


def _build_traffic(cfg: ModelConfig, trainer: TrainerLayout, engine: EngineLayout, name: str) -> Traffic:
    if name not in STRATEGIES:
        raise KvmoveError(f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})")
    trainer.validate(cfg)
    engine.validate(cfg)
    strategy = STRATEGIES[name]
    plans = _cached(("plans", cfg, engine), lambda: plan_engine(cfg, engine))
    ownership = Ownership(cfg, trainer)
    by_tensor = name in ("v1", "broadcast")
    groups = tensor_groups(cfg, trainer, STRATEGIES["v1" if by_tensor else name], SyncOptions())
    keys = sorted(groups)
    index = {g: i for i, g in enumerate(keys)}
    group_of = {t.name: index[g] for g, ts in groups.items() for t in ts}
    stage, modules, resumes, gather = _group_facts(
        cfg, trainer, strategy.scope, groups, keys, by_tensor or name == "v2"
    )
    locals_ = [
        (np.array([group_of[r.hf_name] for r in p.regions], dtype=np.int64), np.array([r.nbytes for r in p.regions]))
        for p in plans
    ]
    kept = sum(int(b.sum()) for _, b in locals_) * engine.replicas
    ranks = range(engine.world)
    if name == "broadcast":
        send, recv, total = _broadcast_coo(cfg, engine, groups, keys, locals_)
    else:
        smap = _cached(
            ("route", cfg, trainer, engine, strategy.scope), lambda: route(plans, engine, ownership, strategy)
        )
        g = np.concatenate([locals_[engine.coord(e).local][0] for e in ranks])
        b = np.concatenate([locals_[engine.coord(e).local][1] for e in ranks])
        src = np.concatenate([np.asarray(smap.sources[e], dtype=np.int64) for e in ranks])
        dst = np.concatenate([np.full(len(smap.sources[e]), e, dtype=np.int64) for e in ranks])
        send, recv, total = _coo(g, src, b), _coo(g, dst, b), kept
    return Traffic(name, trainer, engine, total, kept, stage, modules, resumes, gather, send, recv)


def _coo(group: np.ndarray, rank: np.ndarray, nbytes: np.ndarray) -> Coo:
    """Sum bytes and count regions per (group, rank)."""
    width = int(rank.max()) + 1 if len(rank) else 1
    uniq, inv = np.unique(group * width + rank, return_inverse=True)
    return uniq // width, uniq % width, np.bincount(inv, weights=nbytes), np.bincount(inv).astype(float)


def _broadcast_coo(
    cfg: ModelConfig, engine: EngineLayout, groups: dict[int, list[Any]], keys: list[int], locals_: list[Any]
) -> tuple[Coo, Coo, int]:
    """Rank 0 sends every full tensor; every engine rank receives it and keeps its regions."""
    sizes = np.array([sum(t.nbytes for t in groups[k]) for k in keys], dtype=float)
    n = len(keys)
    send = (np.arange(n), np.zeros(n, dtype=np.int64), sizes, np.ones(n))
    gs, rs, bs, cs = [], [], [], []
    for e in range(engine.world):
        g, _ = locals_[engine.coord(e).local]
        counts = np.bincount(g, minlength=n).astype(float)
        gs.append(np.arange(n))
        rs.append(np.full(n, e, dtype=np.int64))
        bs.append(sizes)
        cs.append(counts)
    recv = (np.concatenate(gs), np.concatenate(rs), np.concatenate(bs), np.concatenate(cs))
    return send, recv, int(sizes.sum()) * engine.world


def _group_facts(
    cfg: ModelConfig,
    trainer: TrainerLayout,
    scope: str,
    groups: dict[int, list[Any]],
    keys: list[int],
    per_tensor: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Per group: trainer stage, modules completed (layer-wise reload), iterator resumes, gathers by size."""
    n = len(keys)
    stage, modules, resumes = np.zeros(n, dtype=np.int64), np.zeros(n), np.zeros(n)
    gather: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    last_of: dict[int | None, int] = {}
    for i, k in enumerate(keys):
        ts = groups[k]
        stage[i] = shard_rule(cfg, trainer, ts[0].name).stage
        resumes[i] = len(ts) if per_tensor else 1
        for t in ts:
            last_of[layer_of(t.name)] = i
            size = _gather_size(cfg, trainer, scope, t.name)
            if size > 1:
                if size not in gather:
                    gather[size] = (np.zeros(n), np.zeros(n))
                ops, nbytes = gather[size]
                ops[i] += 1
                nbytes[i] += t.nbytes * (size - 1) / size
    for i in last_of.values():
        modules[i] += 1
    return stage, modules, resumes, gather


def _gather_size(cfg: ModelConfig, trainer: TrainerLayout, scope: str, name: str) -> int:
    """Ranks in the collective that materializes ``name`` (1: none)."""
    if scope in ("global", "root"):
        return trainer.world
    rule = shard_rule(cfg, trainer, name)
    if rule.dim is None:
        return 1
    return trainer.etp if rule.group == "etp" else trainer.tp


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted sync: total seconds, phase sums, speed-of-light bounds, bytes."""

    strategy: str
    constraints: Constraints
    seconds: float
    phases: dict[str, float]
    bytes_total: int
    bytes_kept: int
    speed_of_light_seconds: float
    """Bytes over the binding link at line rate, all stages at once (the absolute bound)."""
    serial_pp_speed_of_light_seconds: float
    """The same, stage after stage (the bound the published engine's serial PP groups allow)."""
    binding_link: str
    notes: tuple[str, ...] = field(default=())

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.seconds / GB if self.seconds > 0 else 0.0

    @property
    def sol_ratio(self) -> float:
        return self.seconds / self.speed_of_light_seconds if self.speed_of_light_seconds > 0 else math.inf


def predict(
    t: Traffic,
    topology: Topology,
    placement: Placement,
    costs: Costs = Costs(),
    constraints: Constraints = KVMOVE,
) -> Prediction:
    """Price ``t`` on ``topology``; pure and fast."""
    serial = constraints.serial_pp or t.strategy in ("v1", "broadcast")
    steps = _steps(t, serial)
    table = _phase_table(t, topology, placement, costs, constraints, steps)
    if t.strategy == "v3":
        seconds = sum(_flow_shop(table[:, idx], costs) for idx in _step_runs(t, steps, serial))
    else:
        seconds = float(table.sum())
    one = np.zeros(t.groups, dtype=np.int64)
    sol, link = _link_time(t, topology, placement, one, 1.0)
    by_stage, _ = _link_time(t, topology, placement, t.group_stage, 1.0)
    return Prediction(
        strategy=t.strategy,
        constraints=constraints,
        seconds=seconds,
        phases={p: float(table[i].sum()) for i, p in enumerate(PHASES)},
        bytes_total=t.bytes_total,
        bytes_kept=t.bytes_kept,
        speed_of_light_seconds=float(sol.max()),
        serial_pp_speed_of_light_seconds=float(by_stage.sum()),
        binding_link=link,
    )


def _steps(t: Traffic, serial: bool) -> np.ndarray:
    """Group -> step: serial keeps groups apart; otherwise the k-th groups of all stages form step k."""
    if serial or t.strategy in ("v1", "broadcast"):
        return np.arange(t.groups)
    if t.strategy == "v2":
        return np.zeros(t.groups, dtype=np.int64)
    pos = np.zeros(t.groups, dtype=np.int64)
    for s in np.unique(t.group_stage):
        idx = np.flatnonzero(t.group_stage == s)
        pos[idx] = np.arange(len(idx))
    return pos


def _step_runs(t: Traffic, steps: np.ndarray, serial: bool) -> list[np.ndarray]:
    """Steps that form one pipeline each: one per stage under serial PP, else all of them."""
    n = int(steps.max()) + 1
    if not serial:
        return [np.arange(n)]
    first_stage = np.zeros(n, dtype=np.int64)
    first_stage[steps] = t.group_stage
    return [np.flatnonzero(first_stage == s) for s in np.unique(first_stage)]


def _phase_table(t: Traffic, top: Topology, pl: Placement, c: Costs, k: Constraints, steps: np.ndarray) -> np.ndarray:
    """Seconds of each phase (rows) of each step (columns)."""
    n = int(steps.max()) + 1
    gather = np.zeros(n)
    per_stage = np.zeros((n, int(t.group_stage.max()) + 1))
    for size, (ops, nbytes) in t.gather.items():
        gpn = top.gpus_per_node
        cross = size > gpn
        # NOTE: latency of a hierarchical ring: NVLink hops inside a node, NIC hops between nodes.
        lat = (min(size, gpn) - 1) * top.nvlink_latency_us + (math.ceil(size / gpn) - 1) * top.nic_latency_us
        rate = top.gpu_nic_rate * c.nic_efficiency if cross else top.nvlink_gbps * GB * c.nccl_efficiency
        secs = ops * (c.collective_launch_s + lat * 1e-6) + nbytes / rate
        np.add.at(per_stage, (steps, t.group_stage), secs)
    np.add.at(per_stage, (steps, t.group_stage), t.group_resumes * c.iter_resume_s)
    gather = per_stage.max(axis=1)
    copy = c.copy_gbps * GB
    pack = _per_rank_max(t.send, steps, n, lambda b, r: r * c.replay_region_s + b / copy)
    load = _per_rank_max(t.recv, steps, n, lambda b, r: r * c.op_launch_s + b / copy)
    if k.layerwise_reload and t.strategy != "broadcast":
        load += np.bincount(steps, weights=t.group_modules, minlength=n) * c.reload_module_s
    link, _ = _link_time(t, top, pl, steps, c.nic_efficiency)
    barrier = c.rpc_s if k.synchronized_replicas and t.engine.replicas > 1 else 0.0
    transfer = link + c.rpc_s + barrier + top.nic_latency_us * 1e-6
    return np.vstack([gather, pack, transfer, load])


def _per_rank_max(coo: tuple[np.ndarray, ...], steps: np.ndarray, n: int, cost: Any) -> np.ndarray:
    group, rank, nbytes, regions = coo
    width = int(rank.max()) + 1
    key = steps[group] * width + rank
    uniq, inv = np.unique(key, return_inverse=True)
    secs = cost(np.bincount(inv, weights=nbytes), np.bincount(inv, weights=regions))
    out = np.zeros(n)
    np.maximum.at(out, uniq // width, secs)
    return out


def _link_time(t: Traffic, top: Topology, pl: Placement, steps: np.ndarray, eff: float) -> tuple[np.ndarray, str]:
    """Per step, the busiest link's seconds: GPU NICs and node NICs, sending (trainer) and receiving (engine)."""
    n = int(steps.max()) + 1
    worst, best, name = np.zeros(n), -1.0, "none"
    for side, coo, node_of in (("trainer", t.send, pl.trainer_node), ("engine", t.recv, pl.engine_node)):
        group, rank, nbytes, _ = coo
        step = steps[group]
        gpu = np.zeros((n, len(node_of)))
        np.add.at(gpu, (step, rank), nbytes)
        node = np.zeros((n, pl.nodes))
        np.add.at(node, (step, np.asarray(node_of)[rank]), nbytes)
        for label, secs in (
            (f"{side} GPU NIC", gpu.max(axis=1) / (top.gpu_nic_rate * eff)),
            (f"{side} node NICs", node.max(axis=1) / (top.node_nic_rate * eff)),
        ):
            if secs.sum() > best:
                best, name = float(secs.sum()), label
            worst = np.maximum(worst, secs)
    return worst, name


def _flow_shop(table: np.ndarray, c: Costs) -> float:
    """Makespan of steps through the four phases, each a single server, with bounded buffers."""
    n = table.shape[1]
    done = np.zeros((len(PHASES), n))
    for g in range(n):
        for p in range(len(PHASES)):
            start = max(done[p - 1, g] if p else 0.0, done[p, g - 1] if g else 0.0)
            if p == 0 and g > c.lookahead:
                start = max(start, done[2, g - c.lookahead - 1])  # gather waits for the group release
            if p == 2 and g >= c.num_buffers:
                start = max(start, done[3, g - c.num_buffers])  # a ring slot frees once its group is loaded
            done[p, g] = start + table[p, g]
    return float(done[-1, -1]) if n else 0.0


def simulate(
    cfg: ModelConfig,
    trainer: TrainerLayout,
    engine: EngineLayout,
    strategies: list[str],
    topology: Topology,
    trainer_nodes: int,
    engine_nodes: int,
    constraints: Constraints = KVMOVE,
    costs: Costs = Costs(),
) -> list[Prediction]:
    """Predict every strategy for one setup (plans and routing are built once per process and cached)."""
    placement = place(topology, trainer, engine, trainer_nodes, engine_nodes)
    return [predict(traffic(cfg, trainer, engine, s), topology, placement, costs, constraints) for s in strategies]


@dataclass(frozen=True)
class Setup:
    """A published run's setup, as our CLI spells it (node counts and NICs: see ``assumptions``)."""

    name: str
    model: str
    trainer: str
    engine: str
    replicas: int
    trainer_nodes: int
    engine_nodes: int
    cluster: str = "gpus_per_node=8,nic_gbps=400,nics_per_node=8,nvlink_gbps=450"
    assumptions: str = ""


class Figure(NamedTuple):
    """One published figure: ``metric`` is "seconds", "gib_per_s" or "bytes"."""

    setup: str
    strategy: str
    metric: str
    value: float
    source: str


SETUPS: dict[str, Setup] = {
    s.name: s
    for s in (
        Setup(
            "qwen3-235b",
            "qwen3-235b-a22b",
            "tp=4,pp=2,ep=8",
            "dp=16,ep=16",
            1,
            2,
            2,
            assumptions="8xH100 nodes, 8 NICs x 400 Gb/s per node (NIC count unstated), one DP16/EP16 engine",
        ),
        Setup(
            "kimi-k2",
            "kimi-k2",
            "tp=8,pp=8,ep=32",
            "tp=32,ep=32",
            4,
            32,
            16,
            assumptions="BF16, 4 replicas of TP32/EP32 on 16 nodes (the post's 400x4 GB/s per replica), "
            "8 NICs x 400 Gb/s per node",
        ),
    )
}

FIGURES = (
    Figure("qwen3-235b", "v1", "seconds", 25.02, "vLLM blog [B]"),
    Figure("qwen3-235b", "v2", "seconds", 5.61, "vLLM blog [B]"),
    Figure("qwen3-235b", "v3", "seconds", 3.49, "vLLM blog [B]"),
    Figure("qwen3-235b", "broadcast", "seconds", 64.72, "SkyRL NCCL broadcast [B]"),
    Figure("kimi-k2", "v3", "seconds", 7.53, "vLLM blog [B]"),
    Figure("kimi-k2", "v3", "bytes", 7899 * 2**30, "vLLM blog [B]: '7.9 TB' = 7,899 GiB"),
    Figure("kimi-k2", "v3", "gib_per_s", 1049.0, "vLLM blog [B]: '1,049 GB/s' = GiB/s (7,899 GiB / 7.53 s)"),
)
FIT_TARGETS = (("qwen3-235b", "v3"), ("kimi-k2", "v3"))
"""The figures the two fit parameters (nic_efficiency, reload_module_s) were fit to; the others are predictions."""


def simulate_setup(
    setup: Setup, strategies: list[str], constraints: Constraints, costs: Costs = Costs()
) -> list[Prediction]:
    from kvmove.models import resolve_model

    cfg = resolve_model(setup.model)
    trainer, engine = TrainerLayout.parse(setup.trainer), EngineLayout.parse(setup.engine, setup.replicas)
    topology = Topology.parse(setup.cluster)
    return simulate(
        cfg, trainer, engine, strategies, topology, setup.trainer_nodes, setup.engine_nodes, constraints, costs
    )


class Comparison(NamedTuple):
    figure: Figure
    simulated: float

    @property
    def error(self) -> float:
        return self.simulated / self.figure.value - 1.0


def figure_value(p: Prediction, metric: str) -> float:
    if metric == "seconds":
        return p.seconds
    if metric == "bytes":
        return float(p.bytes_total)
    return p.bytes_total / 2**30 / p.seconds


def compare_published(costs: Costs = Costs()) -> list[Comparison]:
    """Every published figure next to its simulation with the published engine's constraints on."""
    out = []
    for f in FIGURES:
        (p,) = simulate_setup(SETUPS[f.setup], [f.strategy], PUBLISHED, costs)
        out.append(Comparison(f, figure_value(p, f.metric)))
    return out


FIT_EFFICIENCIES = tuple(i / 100 for i in range(70, 101, 5))
FIT_RELOADS = tuple(i / 1000 for i in range(0, 61, 2))


def fit_costs(
    base: Costs = Costs(),
    efficiencies: tuple[float, ...] = FIT_EFFICIENCIES,
    reloads: tuple[float, ...] = FIT_RELOADS,
) -> Costs:
    """Grid-fit nic_efficiency and reload_module_s to :data:`FIT_TARGETS` (least squares of log errors)."""
    targets = [f for f in FIGURES if (f.setup, f.strategy) in FIT_TARGETS and f.metric == "seconds"]
    best: tuple[float, Costs] | None = None
    for eff in efficiencies:
        for reload in reloads:
            c = replace(base, nic_efficiency=eff, reload_module_s=reload)
            errs = [
                math.log(simulate_setup(SETUPS[f.setup], [f.strategy], PUBLISHED, c)[0].seconds / f.value)
                for f in targets
            ]
            score = sum(e * e for e in errs)
            if best is None or score < best[0]:
                best = (score, c)
    assert best is not None
    return best[1]


@dataclass(frozen=True)
class Calibration:
    """Costs plus, per field, where its value comes from."""

    costs: Costs
    sources: dict[str, str]


def calibrate(results: Any = None, base: Costs = Costs()) -> Calibration:
    """Replace what this machine can measure with measured rows of ``results`` (a DataFrame from load_results).

    Measurable from rows: the per-region replay cost of packing, from measured sync rows' ``pack`` phase over the
    regions the busiest trainer rank packed (plans rebuilt from the row's model and layouts). Only rows measured
    on GPU hosts (``hardware`` names a GPU) are applied; CPU rows are reported in the sources but not applied,
    because CPU Ray actors' per-pull overheads and byte rates do not transfer to an H100 cluster.
    """
    sources = dict(COST_SOURCES)
    gpu = _measured_replay(results, gpu=True)
    cpu = _measured_replay(results, gpu=False)
    if cpu is not None:
        sources["replay_region_s"] += (
            f"; measured on CPU rows here: {cpu[0] * 1e6:.0f} us per region over {cpu[1]} sync row(s) "
            "(Ray actors on a small CPU host; not applied to GPU clusters)"
        )
    if gpu is None:
        return Calibration(base, sources)
    value, rows = gpu
    sources["replay_region_s"] = f"measured: median pack seconds per region over {rows} GPU sync row(s) in results/"
    return Calibration(replace(base, replay_region_s=value), sources)


def _measured_replay(df: Any, gpu: bool) -> tuple[float, int] | None:
    import json

    if df is None or len(df) == 0 or "suite" not in df.columns:
        return None
    rows = df[(df["kind"] == "measured") & (df["suite"] == "sync") & df["strategy"].isin(["v2", "v3"])]
    on_gpu = rows["hardware"].astype(str).str.contains("gpu|cuda|h100|h200|a100", case=False, regex=True)
    rows = rows[on_gpu if gpu else ~on_gpu]
    values = []
    for _, r in rows.iterrows():
        try:
            pack = float(json.loads(r["phases"]).get("pack", 0.0))
            regions = _max_regions_per_trainer(str(r["model"]), str(r["trainer"]), str(r["engine"]), str(r["strategy"]))
        except Exception:  # a row we cannot rebuild (custom config, older label format) is skipped
            continue
        if pack > 0 and regions > 0:
            values.append(pack / regions)
    return (float(np.median(values)), len(values)) if values else None


def _max_regions_per_trainer(model: str, trainer: str, engine: str, strategy: str) -> int:
    from kvmove.models import resolve_model

    layout, _, reps = engine.partition(" x")
    cfg = resolve_model(model)
    t = traffic(cfg, TrainerLayout.parse(trainer), EngineLayout.parse(layout, int(reps or 1)), strategy)
    _, rank, _, regions = t.send
    return int(np.bincount(rank, weights=regions).max())


def prediction_row(p: Prediction, setup: Setup, calibration: Calibration, figures: tuple[Figure, ...] = FIGURES) -> Any:
    """A ``Row(kind="simulated")`` for the results store, with the published figure it compares to, if any."""
    from kvmove.bench.results import Row

    published = {f.metric: f.value for f in figures if (f.setup, f.strategy) == (setup.name, p.strategy)}
    limit = p.bytes_total / p.speed_of_light_seconds / GB if p.speed_of_light_seconds > 0 else 0.0
    return Row(
        kind="simulated",
        suite="simulated",
        name=f"simulate {setup.name} {p.strategy} ({p.constraints.label})",
        model=setup.model,
        trainer=setup.trainer,
        engine=f"{setup.engine} x{setup.replicas}",
        strategy=p.strategy,
        transport="nccl-broadcast" if p.strategy == "broadcast" else "rdma-pull",
        bytes=p.bytes_total,
        seconds=p.seconds,
        gbps=p.gbps,
        phases=p.phases,
        link_limit_gbps=limit,
        extra={
            "setup": setup.name,
            "constraints": p.constraints.label,
            "serial_pp": p.constraints.serial_pp,
            "layerwise_reload": p.constraints.layerwise_reload,
            "synchronized_replicas": p.constraints.synchronized_replicas,
            "speed_of_light_seconds": p.speed_of_light_seconds,
            "serial_pp_speed_of_light_seconds": p.serial_pp_speed_of_light_seconds,
            "sol_ratio": p.sol_ratio,
            "binding_link": p.binding_link,
            "bytes_kept": p.bytes_kept,
            "gib_per_s": p.bytes_total / 2**30 / p.seconds if p.seconds > 0 else 0.0,
            "cluster": setup.cluster,
            "trainer_nodes": setup.trainer_nodes,
            "engine_nodes": setup.engine_nodes,
            "assumptions": setup.assumptions,
            "costs": asdict(calibration.costs),
            "cost_sources": calibration.sources,
            "published": published if p.constraints == PUBLISHED else {},
        },
    )


def setup_rows(calibration: Calibration | None = None) -> list[Any]:
    """Simulated rows for every published setup, every strategy, with and without the published constraints."""
    calibration = calibration or calibrate()
    rows = []
    for setup in SETUPS.values():
        for constraints in (PUBLISHED, KVMOVE):
            for p in simulate_setup(setup, list(STRATEGIES), constraints, calibration.costs):
                rows.append(prediction_row(p, setup, calibration))
    return rows
