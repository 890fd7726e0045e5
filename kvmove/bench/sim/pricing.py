"""Seconds of a sync: a strategy's traffic priced on a cluster with a cost book.

Per step (the groups that run together: one group, or the k-th group of every pipeline stage) each phase is the
busiest rank's work:
- gather: yields x materialize_s, all-gathers x collective_s + bytes at NCCL speed (NVLink inside a node, NICs
  across), host<->device bytes at pinned-copy speed;
- pack: regions x replay_region_s + bytes at the packing rate + FP8 quantization (read 2 B, write 1 B per element
  at the HBM's rate) when the trainer quantizes;
- transfer: the busiest link (each GPU's NIC share and each node's NICs, both sides; NVLink when colocated) at the
  transport's efficiency, plus per-pull and per-region operation costs;
- relay (fan-out between replicas): per hop, the forwarding GPU's bytes at the same efficiency;
- load: regions x load_region_s + scattered bytes at the load rate + engine-side quantization (the engine's own, or
  its mapped pulls' one after another: ``kvmove.bench.sim.mapped``), and, with the published engine's layer-wise
  reload, reload_layer_s and a copy of its bytes per decoder layer.
Mapped pulls started ahead (v3) run on their own stream from the sync's start: the sync lasts at least their
quantization, and no sync beats it at the HBM's line rate.
Unpipelined strategies run phases and steps back to back; pipelined ones flow through the phases with at most
``lookahead`` groups gathered ahead of release and ``num_buffers`` groups between transfer and load.
Every rate is a vendor line rate times an efficiency in (0, 1], so no step beats its own line-rate transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvmove.bench.sim.costs import CostBook, expert_scan
from kvmove.bench.sim.flow import flow_shop, one_update
from kvmove.bench.sim.hardware import rounds
from kvmove.bench.sim.mapped import ahead_seconds, floor_seconds
from kvmove.bench.sim.setup import BUCKET_CALLS, SimSetup
from kvmove.bench.sim.traffic import Traffic

EFFICIENCY = {
    "pull": "pull_efficiency",
    "push": "push_efficiency",
    "nccl": "nccl_efficiency",
    "cuda-ipc": "ipc_efficiency",
}


class Steps(NamedTuple):
    """Per step: summed trainer/engine rows, collectives, multiplicity, largest request, layers completed."""

    t: dict[str, np.ndarray]
    e: dict[str, np.ndarray]
    gather: dict[int, tuple[np.ndarray, np.ndarray]]
    times: np.ndarray
    max_request: np.ndarray
    layers: np.ndarray
    stage: np.ndarray


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted sync on one setup."""

    strategy: str
    seconds: float
    phases: dict[str, float]
    bytes_moved: float
    """Wire bytes the engine ranks receive, and FP8 bytes they land from mapped arenas, all replicas."""
    bytes_kept: float
    speed_of_light_seconds: float
    """This strategy's transfers at line rate, everything at once (no overheads, no efficiencies)."""
    receiver_bound_seconds: float
    """The bytes the busiest engine GPU keeps, through all of its node's NICs (or its local link) at line rate:
    no strategy can beat it."""
    serial_pp_speed_of_light_seconds: float
    binding_link: str
    steps: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def sol_ratio(self) -> float:
        return self.seconds / self.speed_of_light_seconds if self.speed_of_light_seconds > 0 else float("nan")


def price(traffic: Traffic, s: SimSetup, book: CostBook, totals: Traffic | None = None) -> Prediction:
    """Predict one sync of ``traffic`` on ``s`` priced with ``book``.

    ``totals``: the same strategy grouped by decoder block, for per-rank totals (speed of light, receiver bound)
    when ``traffic`` keeps one representative per kind of tensor (whose ranks are not the ones every copy uses).
    """
    whole = totals or traffic
    steps = _steps(traffic, s)
    table = _phase_table(steps, traffic, s, book)
    if s.constraints.one_update and len(np.unique(steps.stage)) > 1:
        seconds = one_update(table, steps.stage)
    elif traffic.strategy.pipelined:
        seconds = flow_shop(table, s)
    else:
        seconds = float((table.sum(axis=0) * steps.times).sum())
    mapped = ahead_seconds(whole, s, book)  # on a stream of their own from the sync's start (v3)
    seconds = max(seconds, mapped)
    if s.cold:
        seconds += book["cold_s_per_byte"] * float(whole.total("engine", "kept").max())
    seconds += book["sync_s"]
    seconds += _host_rounds(whole, s, book)
    phases = _phase_sums(table, steps.times)
    phases["load"] += mapped
    whole_steps = _steps(whole, s)
    floor = floor_seconds(whole, s)  # the engines' mapped quantization at the HBM's line rate
    sol, link = _speed_of_light(whole, s, whole_steps, by_stage=False)
    serial, _ = _speed_of_light(whole, s, whole_steps, by_stage=True)
    if floor > sol:
        sol, serial, link = floor, max(serial, floor), "HBM (mapped quantization)"
    return Prediction(
        strategy=traffic.strategy.name,
        seconds=seconds,
        phases=phases,
        bytes_moved=traffic.moved_per_replica * s.engine.replicas,
        bytes_kept=traffic.kept_per_replica * s.engine.replicas,
        speed_of_light_seconds=sol,
        receiver_bound_seconds=float(whole.total("engine", "kept").max())
        / _ingress_rate(s, traffic.strategy.broadcast),
        serial_pp_speed_of_light_seconds=serial,
        binding_link=link,
        steps=len(steps.times),
    )


def _steps(traffic: Traffic, s: SimSetup) -> Steps:
    """Group -> step: serial (one group per step) for per-tensor groups, serial PP or one-stage trainers;
    otherwise the k-th groups of all stages form step k."""
    stage = traffic.stage
    serial = s.constraints.serial_pp or s.constraints.one_update
    if traffic.strategy.grouping == "tensor" or serial or len(np.unique(stage)) == 1:
        step = np.arange(traffic.groups)
    else:
        step = np.zeros(traffic.groups, dtype=np.int64)
        for st in np.unique(stage):
            idx = np.flatnonzero(stage == st)
            step[idx] = np.arange(len(idx))
    n = int(step.max()) + 1
    first = np.full(n, -1, dtype=np.int64)
    for g in range(traffic.groups):
        first[step[g]] = g if first[step[g]] < 0 else first[step[g]]

    def fold(a: np.ndarray) -> np.ndarray:
        out = np.zeros((n, *a.shape[1:]))
        np.add.at(out, step, a)
        return out

    gather = {k: (fold(ops), fold(nbytes)) for k, (ops, nbytes) in traffic.gather.items()}
    max_request = np.zeros(n)
    np.maximum.at(max_request, step, traffic.max_request)
    return Steps(
        {k: fold(v) for k, v in traffic.t.items()},
        {k: fold(v) for k, v in traffic.e.items()},
        gather,
        traffic.count[first],
        max_request,
        fold(traffic.layers),
        stage[first],
    )


def _phase_table(st: Steps, traffic: Traffic, s: SimSetup, book: CostBook) -> np.ndarray:
    """Seconds of each phase (rows: gather, pack, transfer, load, relay hops...) of each step (columns).

    A relay hop forwards a group from one replica to the next once it has landed; it runs after the first
    replica's load in the flow, outside the first replica's receive-buffer window."""
    c = s.cluster
    copy = c.hbm_rate / 2 * book["copy_efficiency"]
    pack_times = 1.0 if (s.constraints.synchronized_replicas or traffic.strategy.broadcast) else _served(s)
    t = st.t
    gather = _gather(st, s, book, traffic.strategy.grouping == "tensor", traffic.strategy.broadcast and s.funnel)
    # bytes sent by RDMA from host memory (a broadcast copies pinned memory to the device: priced in gather)
    host = 0.0 if traffic.strategy.broadcast else t["send"] if s.trainer.kind == "host" else t["h2d"]
    pack = _rank_max(
        t["calls"] * book["pack_call_s"]
        + t["pack"] / (copy * book["pack_efficiency"])
        + book.quantize_seconds(t["quant"], c.hbm_rate)
        + host * book["host_register_s_per_byte"]
        + t.get("detect", 0.0) / (copy * book["delta_detect_efficiency"])
    )
    if not traffic.strategy.broadcast:
        pack *= pack_times
    transfer = _transfer(st, traffic, s, book)
    relay = _relay(st, s, book)
    hops = 0 if traffic.strategy.broadcast else s.relay_depth
    e = st.e
    own_loader = s.constraints.engine_loader  # the engine's loader runs once per tensor
    calls = e["regions"] if traffic.strategy.broadcast or own_loader else np.maximum(e["pulls"] - e["direct_pulls"], 0)
    load = _rank_max(
        calls * (_loader_s(s, book) if own_loader else book["load_call_s"])
        + e["scatter"] / (copy * book["load_efficiency"])
        + book.quantize_seconds(e["quant"] + (0.0 if traffic.strategy.ahead else e["mapped"]), c.hbm_rate)
        + e.get("apply", 0.0) / (copy * book["delta_apply_efficiency"])
    )
    if s.constraints.layerwise_reload:
        load += st.layers * book["reload_layer_s"] + _rank_max(e["layer_bytes"] / copy)
    return np.vstack([gather, pack, transfer, load, *([relay] * hops)])


def _loader_s(s: SimSetup, book: CostBook) -> float:
    """Seconds an engine's own loader takes per tensor: its call, and its scan of the expert mapping."""
    return book["loader_tensor_s"] + book["loader_scan_s"] * expert_scan(s.model.num_experts)


def _host_rounds(traffic: Traffic, s: SimSetup, book: CostBook) -> float:
    """A host-memory trainer's broadcast copies each round's buckets to the devices before broadcasting them, and
    nothing else runs meanwhile (checkpoint-engine's ``_update_per_bucket``): from each rank's own pinned memory,
    or, with ``remote_host``, read over RDMA by the updated GPUs from the ranks' host memory."""
    if s.trainer.kind != "host" or not traffic.strategy.broadcast:
        return 0.0
    staged = traffic.total("trainer", "h2d")
    if not s.remote_host:
        return float(staged.max()) / (s.cluster.pcie_rate * book["h2d_efficiency"])
    each = float(staged.sum()) / s.engine.ranks_per_replica
    return each / (s.cluster.gpu_nic_rate * book["nic_efficiency"]) + each * book["host_register_s_per_byte"]


def _served(s: SimSetup) -> float:
    """Replicas the trainer serves itself (the others are reached by relays)."""
    return float(s.engine.replicas if s.fanout == "none" else 1)


def _gather(st: Steps, s: SimSetup, book: CostBook, per_tensor: bool, funnel: bool = False) -> np.ndarray:
    """A rank asks its source for a group's tensors in one call (per tensor when groups are tensors:
    ``kvmove.sync.ranks.trainer``), runs its collectives, copies host memory to the device. kvmove's broadcast
    (``funnel``) gathers onto rank 0 with nothing else running, as its broadcast calls run: its collectives are
    priced per step (:data:`ROUNDS`) at ``broadcast_op_s``, not at an on-demand gather's ``collective_s``."""
    c = s.cluster
    calls = st.t["yield"] if per_tensor else np.minimum(st.t["yield"], 1.0)
    staged = 0.0 if s.trainer.kind == "host" else st.t["h2d"] / (c.pcie_rate * book["h2d_efficiency"])
    per_rank = calls * book["materialize_s"] + staged
    nvlink = c.nvlink_rate * book["nccl_efficiency"]
    for n, (ops, nbytes) in st.gather.items():
        inside = abs(n) <= c.gpus_per_node or (s.trainer.kind == "fsdp" and s.trainer.shard <= c.gpus_per_node)
        if inside:
            rate = nvlink
        elif n < 0:  # a broadcast across nodes enters each node once, then fans out over NVLink
            rate = min(nvlink, c.node_nic_rate * book["nic_efficiency"])
        else:  # an all-gather across nodes: each rank's share crosses its NICs
            rate = c.gpu_nic_rate * book["nic_efficiency"]
        op = rounds(c, n) * book["broadcast_op_s"] if funnel else book["collective_s"]
        per_rank = per_rank + ops * op + nbytes / rate
    return _rank_max(per_rank)


def _transfer(st: Steps, traffic: Traffic, s: SimSetup, book: CostBook) -> np.ndarray:
    broadcast = traffic.strategy.broadcast
    eff = book["nccl_efficiency"] if broadcast else book[EFFICIENCY[s.transport]]
    served = 1.0 if broadcast else _served(s)
    steps = _engine_rounds(s) if broadcast and not s.bucket_bytes else 1  # a gloo root sends once per round
    link, _ = _links(
        st.t["send"] * served * steps, st.e["recv"], s, eff, st.max_request, broadcast, book["nic_efficiency"]
    )
    e = st.e
    # a direct pull reads all of its regions from one trainer shard as one batch (kvmove.sync.strategies)
    packed, direct = e["pulls"] - e["direct_pulls"], e["direct_pulls"]
    ops = {
        "pull": packed * (book["request_s"] + book["pull_op_s"]) + direct * book["pull_op_s"],
        "push": (packed + direct) * book["pull_op_s"] + book["request_s"],
        "nccl": (packed + direct) * book["broadcast_op_s"],
        "cuda-ipc": packed * book["request_s"] + direct * book["pull_op_s"],
    }[s.transport]
    if s.bucket_bytes:  # one call per bucket, priced by what the sender waits for
        name = BUCKET_CALLS[s.bucket_call]
        calls = np.full(len(st.times), book[name] if name else 0.0)
    else:  # one broadcast per tensor to every engine rank (one group: kvmove.sync.driver.step)
        calls = _rank_max(st.t["regions"]) * book["broadcast_op_s"] * steps
    overhead = calls if broadcast else _rank_max(ops)
    if s.constraints.synchronized_replicas and s.engine.replicas > 1:
        overhead = overhead + book["request_s"]
    return link + overhead


def _engine_rounds(s: SimSetup) -> int:
    """Steps of kvmove's broadcast to the engines: one group of trainer rank 0 and every engine rank."""
    return rounds(s.cluster, -(1 + s.engine.world))


def _relay(st: Steps, s: SimSetup, book: CostBook) -> np.ndarray:
    if not s.relay_depth:
        return np.zeros(len(st.times))
    forward = _rank_max(st.e["recv"]) * s.relay_children / (s.cluster.gpu_nic_rate * book["nic_efficiency"])
    return forward + _rank_max(st.e["pulls"]) * (book["request_s"] + book["pull_op_s"])


def _links(
    send: np.ndarray,
    recv: np.ndarray,
    s: SimSetup,
    eff: float,
    largest: np.ndarray,
    broadcast: bool,
    nic: float | None = None,
) -> tuple[np.ndarray, str]:
    """Per step, the busiest link's seconds (and its name, by total): NVLink/PCIe at the transport's ``eff``,
    NICs at ``nic`` (the NIC efficiency; ``eff`` when not given)."""
    nic = eff if nic is None else nic
    c = s.cluster
    local = _local_link(s, broadcast)
    if local:
        name, line = local
        worst = np.maximum(_rank_max(send), _rank_max(recv))
        if c.gpu.cores and not broadcast:  # a host's cores bound how many ranks' pulls progress at once
            worst = np.maximum(worst, np.maximum(send.sum(axis=1), recv.sum(axis=1) * s.engine.replicas) / c.gpu.cores)
        return np.maximum(worst, largest) / (line * eff), name
    gpn = c.gpus_per_node
    candidates = {
        "trainer GPU NIC": np.maximum(_rank_max(send), largest) / (c.gpu_nic_rate * nic),
        "trainer node NICs": _node_max(send, gpn) / (c.node_nic_rate * nic),
    }
    if broadcast:  # NCCL's rings and trees carry a broadcast into each node once, then over NVLink
        candidates["engine node NICs"] = _rank_max(recv) / (c.node_nic_rate * nic)
        candidates["engine NVLink"] = _rank_max(recv) / (c.nvlink_rate * eff)
    else:
        candidates["engine GPU NIC"] = _rank_max(recv) / (c.gpu_nic_rate * nic)
        candidates["engine node NICs"] = _engine_node(recv, s) / (c.node_nic_rate * nic)
    name = max(candidates, key=lambda k: float(candidates[k].sum()))
    return np.max(np.vstack(list(candidates.values())), axis=0), name


def _speed_of_light(traffic: Traffic, s: SimSetup, st: Steps, by_stage: bool) -> tuple[float, str]:
    """Line-rate transfer time of this traffic (all at once, or stage after stage)."""
    broadcast = traffic.strategy.broadcast
    served = 1.0 if broadcast else _served(s)
    children = 0 if broadcast or not s.relay_depth else s.relay_children
    send, recv = st.t["send"] * st.times[:, None] * served, st.e["recv"] * st.times[:, None]
    keys = np.unique(st.stage) if by_stage else [None]
    total, name = 0.0, "none"
    for key in keys:
        rows = np.ones(len(st.times), dtype=bool) if key is None else st.stage == key
        links, name = _links(send[rows].sum(axis=0)[None], recv[rows].sum(axis=0)[None], s, 1.0, np.zeros(1), broadcast)
        forward = float(recv[rows].sum(axis=0).max()) * children / s.cluster.gpu_nic_rate
        if forward > links[0]:
            name = "engine GPU NIC (forwarding)"
        total += max(float(links[0]), forward)
    return total, name


def _local_link(s: SimSetup, broadcast: bool = False) -> tuple[str, float] | None:
    """The link a sync uses when it never crosses nodes' NICs: PCIe from host memory (a broadcast copies to
    the device first and then uses NVLink), NVLink between GPUs, a device copy (HBM / 2) on a one-GPU node."""
    if s.cluster.gpus_per_node == 1 and s.placement == "colocated" and s.trainer.kind != "host":
        return "device copy", s.cluster.hbm_rate / 2
    if s.trainer.kind == "host" and s.placement == "colocated" and s.nodes == 1 and not broadcast:
        return "host PCIe", s.cluster.pcie_rate
    if s.nodes == 1 or (s.placement == "colocated" and s.trainer.kind != "host"):
        return "NVLink", s.cluster.nvlink_rate
    return None


def _ingress_rate(s: SimSetup, broadcast: bool) -> float:
    local = _local_link(s, broadcast)
    return local[1] if local else s.cluster.node_nic_rate


def _rank_max(a: np.ndarray) -> np.ndarray:
    return np.asarray(a.max(axis=1)) if a.shape[1] else np.zeros(a.shape[0])


def _node_max(per_rank: np.ndarray, gpn: int) -> np.ndarray:
    world = per_rank.shape[1]
    nodes = -(-world // gpn)
    padded = np.zeros((per_rank.shape[0], nodes * gpn))
    padded[:, :world] = per_rank
    return np.asarray(padded.reshape(per_rank.shape[0], nodes, gpn).sum(axis=2).max(axis=1))


def _engine_node(recv: np.ndarray, s: SimSetup) -> np.ndarray:
    """Busiest engine node's ingress: a replica's ranks fill nodes in order; small replicas share a node."""
    gpn, local = s.cluster.gpus_per_node, s.engine.ranks_per_replica
    if local >= gpn:
        return _node_max(recv, gpn)
    sharing = min(s.engine.replicas, gpn // local)
    return np.asarray(recv.sum(axis=1) * sharing)


def _phase_sums(table: np.ndarray, count: np.ndarray) -> dict[str, float]:
    rows = ["gather", "pack", "transfer", "load", *(["relay"] * (table.shape[0] - 4))]
    out: dict[str, float] = {}
    for name, row in zip(rows, table, strict=True):
        out[name] = out.get(name, 0.0) + float((row * count).sum())
    return out
