"""What a simulated sync is of: model, weight format, trainer kind and layout, engines, placement, transport,
fan-out, cluster and the published engine's constraints. Frozen, validated once, built at the CLI edge."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from kvmove.bench.sim.fractions import DeltaFractions
from kvmove.bench.sim.hardware import Cluster
from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout, TrainerLayout

TRAINER_KINDS = ("megatron", "fsdp", "host")
PLACEMENTS = ("disaggregated", "colocated")
TRANSPORTS = ("pull", "push", "nccl", "cuda-ipc")
FANOUTS = ("none", "chain", "tree")
DTYPES = ("bf16", "fp8")
QUANTIZE_ON = ("trainer", "engine", "none")


@dataclass(frozen=True)
class TrainerSpec:
    """``megatron``: TP/PP/EP/ETP shards on GPUs; ``fsdp``: every tensor sharded on dim 0 over ``shard`` ranks,
    ``world // shard`` mesh groups materializing disjoint layers with ``full_tensor()``; ``host``: full tensors
    in pinned host memory, spread over ``world`` ranks (checkpoint-engine's parameter server)."""

    kind: str = "megatron"
    layout: TrainerLayout = field(default_factory=TrainerLayout)
    shard: int = 1

    @classmethod
    def parse(cls, text: str) -> TrainerSpec:
        """``tp=4,pp=2,ep=8`` or ``megatron:tp=..``; ``fsdp:world=256,shard=8``; ``host:world=16``."""
        kind, sep, rest = text.partition(":")
        if not sep:
            kind, rest = "megatron", text
        kind = kind.strip()
        if kind == "megatron":
            return cls("megatron", TrainerLayout.parse(rest))
        if kind not in TRAINER_KINDS:
            raise KvmoveError(f"trainer {text!r}: kind must be one of {', '.join(TRAINER_KINDS)}")
        values = _ints(text, rest, ("world", "shard"))
        world = values.get("world", 1)
        shard = values.get("shard", world) if kind == "fsdp" else 1
        if world % shard:
            raise KvmoveError(f"trainer {text!r}: shard ({shard}) must divide world ({world})")
        return cls(kind, TrainerLayout(dp=world), shard)

    @property
    def world(self) -> int:
        return self.layout.world

    def label(self) -> str:
        if self.kind == "megatron":
            return self.layout.label()
        if self.kind == "fsdp":
            return f"fsdp:world={self.world},shard={self.shard}"
        return f"host:world={self.world}"


@dataclass(frozen=True)
class Constraints:
    """The published vLLM engine's limits: switch them on to compare with its figures."""

    serial_pp: bool = False
    """Transfers serialized across trainer PP stages (layer-wise reload would otherwise run out of memory)."""
    layerwise_reload: bool = False
    """vLLM's layer-wise reload: per decoder layer, a fixed cost plus a copy of its bytes."""
    synchronized_replicas: bool = False
    """Replicas pull a group in lockstep: one release barrier per group."""
    one_update: bool = False
    """The engine takes one weight-update request at a time: the trainer's pipeline stages prepare their groups
    concurrently, each waiting for its previous group to land, and reach the engines one after another."""
    engine_loader: bool = False
    """The engine lands weights through its own loader, called per tensor (``loader_tensor_s``, and for a MoE
    model ``loader_scan_s`` per expert-mapping entry it scans), not kvmove's landing programs."""

    @property
    def label(self) -> str:
        return next((name for name, c in CONSTRAINTS.items() if c == self), "custom")


PUBLISHED = Constraints(serial_pp=True, layerwise_reload=True, synchronized_replicas=True)
KVMOVE = Constraints()
CONSTRAINTS: dict[str, Constraints] = {
    "kvmove": KVMOVE,
    "published": PUBLISHED,
    "vllm-nccl": dataclasses.replace(PUBLISHED, engine_loader=True),
    "vllm-ipc": Constraints(engine_loader=True),
    "sglang": Constraints(one_update=True, engine_loader=True),
}
"""Named engines and their limits: kvmove's own; the published vLLM engine of the RDT blog (sharded bytes, layer-wise
reload); the same vLLM fed full tensors by its NCCL weight-transfer engine (its loader per tensor); vLLM fed by
MoonshotAI checkpoint-engine's worker extension over CUDA IPC (its loader per tensor); SGLang, which takes one
weight-update request at a time ("The communicator now only run up to 1 in-flight request at any time",
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/managers/tokenizer_communicator_mixin.py), so a
trainer's pipeline stages reach it one after another, and loads through its own loader."""

BUCKET_CALLS: dict[str, str | None] = {"async": None, "op": "broadcast_op_s", "vllm-packed": "packed_bucket_s"}
"""What a bucketing sender waits for per bucket, as the cost that prices it: nothing on the path (calls dispatched
and awaited once, as miles does), one NCCL broadcast call (verl, checkpoint-engine), or vLLM's packed NCCL
weight-transfer consumer taking one buffer (SkyRL)."""


@dataclass(frozen=True)
class SimSetup:
    """One setup to predict. ``direct``: kvmove's direct pulls (regions inside one trainer shard, or cut along
    several, are read straight from them where the planner's rule finds the reads cheap: no gather, pack or
    scatter; the others are packed, from the one shard holding them without a gather); ``via_host``: gathered
    tensors are staged in pinned host memory and sent from there (a device-to-host copy each); ``cold``: the
    first sync (registration)."""

    model: ModelConfig
    trainer: TrainerSpec
    engine: EngineLayout
    cluster: Cluster = field(default_factory=Cluster)
    trainer_nodes: int = 1
    engine_nodes: int = 1
    placement: str = "disaggregated"
    transport: str = "pull"
    fanout: str = "none"
    dtype: str = "bf16"
    """The engine's weight format; with fp8, ``quantize_on`` says where BF16 becomes FP8 ("none": the source
    already holds FP8, as an FP8 checkpoint in host memory does)."""
    quantize_on: str = "engine"
    block: int = 128
    direct: bool = False
    via_host: bool = False
    constraints: Constraints = KVMOVE
    group_size: int = 1
    lookahead: int = 1
    num_buffers: int = 2
    cold: bool = False
    bucket_bytes: int = 0
    """A broadcast sender's bucket: tensors go out in buckets of this many bytes, one broadcast call per bucket
    (0: one call per tensor, as kvmove's broadcast makes them)."""
    bucket_call: str = "op"
    """What the sender waits for per bucket (:data:`BUCKET_CALLS`)."""
    ep_gather: bool = False
    """The trainer all-gathers expert shards over its EP group before sending, as a broadcast does, so any rank
    of the stage serves any expert (miles' P2P path gathers "identically" to its broadcast path)."""
    remote_host: bool = False
    """A host-memory trainer's broadcast reads each bucket over RDMA from the host memory holding it before
    broadcasting it, instead of copying it from its own pinned memory (checkpoint-engine's P2P update)."""
    delta: DeltaFractions | None = None
    """A delta sync at these changed fractions per region class (``kvmove.bench.sim.delta``); None: dense."""

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("placement", self.placement, PLACEMENTS),
            ("transport", self.transport, TRANSPORTS),
            ("fanout", self.fanout, FANOUTS),
            ("dtype", self.dtype, DTYPES),
            ("quantize_on", self.quantize_on, QUANTIZE_ON),
            ("bucket_call", self.bucket_call, tuple(BUCKET_CALLS)),
        ):
            if value not in allowed:
                raise KvmoveError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        for name in ("trainer_nodes", "engine_nodes", "block", "group_size", "num_buffers"):
            if getattr(self, name) < 1:
                raise KvmoveError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lookahead", "bucket_bytes"):
            if getattr(self, name) < 0:
                raise KvmoveError(f"{name} must be >= 0, got {getattr(self, name)}")
        self._check_layouts()
        self._check_placement()

    def _check_layouts(self) -> None:
        fused = _fused_experts(self.model)
        if fused is not None:
            raise KvmoveError(
                f"the simulator prices checkpoints that hold one tensor per expert; {self.model.name} holds every "
                f"expert of a layer in one ({fused}), whose split over EP it does not model"
            )
        if self.trainer.kind == "megatron":
            self.trainer.layout.validate(self.model)
        self.engine.validate(self.model)
        if self.dtype == "fp8":
            check_fp8_engine(self.model, self.engine, self.block)
        gpn = self.cluster.gpus_per_node
        for who, world, nodes in (
            ("trainer", self.trainer.world, self.trainer_nodes),
            ("engine", self.engine.world, self.engine_nodes),
        ):
            if world > nodes * gpn:
                raise KvmoveError(f"{who} needs {world} GPUs but {nodes} node(s) x {gpn} GPUs hold {nodes * gpn}")

    def _check_placement(self) -> None:
        outgrows = self.engine.world > self.trainer.world or self.engine_nodes != self.trainer_nodes
        if self.placement == "colocated" and outgrows:
            raise KvmoveError(
                "colocated placement puts engine ranks on the trainer's GPUs: engine GPUs "
                f"({self.engine.world}) must not exceed trainer GPUs ({self.trainer.world}) on the same nodes"
            )
        if self.transport == "cuda-ipc" and self.placement != "colocated" and self.nodes > 1:
            raise KvmoveError("cuda-ipc reaches GPUs of one node: use --placement colocated or a single node")
        if self.fanout != "none" and self.engine.replicas < 2:
            raise KvmoveError(f"fan-out {self.fanout!r} relays between replicas: it needs --replicas >= 2")
        if self.direct and self.trainer.kind != "megatron":
            raise KvmoveError("direct pulls read Megatron shards in place: they need a megatron trainer")
        if self.remote_host and self.trainer.kind != "host":
            raise KvmoveError("remote host reads fetch buckets from host memory: they need a host:world=N trainer")

    @property
    def funnel(self) -> bool:
        """A broadcast here is kvmove's own (one call per tensor, a Megatron trainer): every tensor is gathered in
        its group, brought to trainer rank 0 and broadcast by it alone (``kvmove.sync.ranks.broadcast.send_all``).
        A bucketing sender (``bucket_bytes``) is a framework's: each pipeline stage's root sends its own tensors."""
        return self.bucket_bytes == 0 and self.trainer.kind == "megatron"

    @property
    def wire_dtype(self) -> str:
        """What moves: FP8 when the weights are quantized before they leave (trainer, or an FP8 source)."""
        return "fp8" if self.dtype == "fp8" and self.quantize_on != "engine" else "bf16"

    @property
    def nodes(self) -> int:
        return self.trainer_nodes if self.placement == "colocated" else self.trainer_nodes + self.engine_nodes

    @property
    def relay_depth(self) -> int:
        """Hops after the first replica: a chain forwards R-1 times, a binary tree ceil(log2 R) times."""
        r = self.engine.replicas
        return {"none": 0, "chain": r - 1, "tree": math.ceil(math.log2(r)) if r > 1 else 0}[self.fanout]

    @property
    def relay_children(self) -> int:
        return {"none": 0, "chain": 1, "tree": 2}[self.fanout]

    def label(self) -> str:
        parts = [
            self.model.name,
            f"trainer {self.trainer.label()}",
            f"engine {self.engine.label()}",
            self.dtype + (f" (quantized on {self.quantize_on})" if self.dtype == "fp8" else ""),
            self.placement,
            self.transport + (" direct" if self.direct else "") + (" via host" if self.via_host else ""),
        ]
        if self.fanout != "none":
            parts.append(f"{self.fanout} fan-out")
        if self.bucket_bytes:
            parts.append(f"{self.bucket_bytes / 2**30:g} GiB buckets")
        if self.delta is not None:
            parts.append(f"delta ({self.delta.text()})")
        return ", ".join(parts)


def _fused_experts(cfg: ModelConfig) -> str | None:
    """The first tensor of ``cfg`` holding every routed expert of a layer (gpt-oss, Llama 4), if any."""
    from kvmove.models.table import table_of

    table = table_of(cfg)
    tensors = [t for _, ts in table.templates.values() for t in ts]
    return next((t.name for t in tensors if t.routed and t.expert is None), None)


def _ints(text: str, rest: str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key.strip() not in keys:
            raise KvmoveError(f"trainer {text!r}: {part!r} is not one of {', '.join(keys)}=N")
        try:
            out[key.strip()] = int(raw)
        except ValueError:
            raise KvmoveError(f"trainer {text!r}: {key.strip()} must be an integer, got {raw!r}") from None
        if out[key.strip()] < 1:
            raise KvmoveError(f"trainer {text!r}: {key.strip()} must be >= 1")
    return out


def check_fp8_engine(model: ModelConfig, engine: EngineLayout, block: int) -> None:
    """Refuse (LayoutError, naming the layer) an FP8 engine layout whose TP split cuts a quantization block, as
    vLLM does: the rule is kvmove's reference engine's (``kvmove.reference.layers``), checked by building the
    first and last layers of a replica's first and last rank on the meta device. Only the engine's own block size
    (128) is checked; a figure's other block (LMSYS's 64x64) is taken as its source states."""
    from kvmove.models.checkpoint import engine_format, with_engine_dtype

    fp8 = with_engine_dtype(model, "fp8")
    if block != engine_format(fp8).weight_block:
        return
    key = (json.dumps(dataclasses.asdict(fp8), sort_keys=True, default=str), engine.tp, engine.dp, engine.ep, engine.pp)
    if key in _FP8_SERVED:
        return
    from kvmove.engines import get_engine

    reference, layout = get_engine("reference"), dataclasses.replace(engine, replicas=1)
    for rank in sorted({0, layout.ranks_per_replica - 1}):
        reference.build(fp8, layout, layout.coord(rank), layers=[0, fp8.num_hidden_layers - 1], device="meta")
    _FP8_SERVED.add(key)


_FP8_SERVED: set[tuple[str, int, int, int, int]] = set()
"""FP8 engine layouts already found servable, per model (a check builds two ranks' layers)."""


@dataclass(frozen=True)
class Spec:
    """A setup as flags spell it (plain values): what rows record so ``--regenerate`` can rebuild it."""

    model: str = "qwen3-235b-a22b"
    trainer: str = "tp=4,pp=2,ep=8"
    engine: str = "dp=16,ep=16"
    replicas: int = 1
    trainer_nodes: int = 2
    engine_nodes: int = 2
    cluster: str = "gpu=h100,nic=cx7-400"
    placement: str = "disaggregated"
    transport: str = "pull"
    fanout: str = "none"
    dtype: str = "bf16"
    quantize_on: str = "engine"
    block: int = 128
    direct: bool = False
    via_host: bool = False
    constraints: str = "kvmove"
    group_size: int = 1
    lookahead: int = 1
    num_buffers: int = 2
    cold: bool = False
    overrides: tuple[str, ...] = ()
    bucket_bytes: int = 0
    bucket_call: str = "op"
    ep_gather: bool = False
    remote_host: bool = False
    delta: str = ""
    """Changed fractions of a delta sync as ``--delta-fraction`` spells them once resolved ("" : dense)."""

    def build(self) -> SimSetup:
        """The validated setup (a KvmoveError names the first bad value)."""
        from kvmove.bench.sim.fractions import parse_fractions
        from kvmove.bench.sim.models import sim_model
        from kvmove.models import parse_overrides, resolve_model

        if self.constraints not in CONSTRAINTS:
            raise KvmoveError(f"constraints {self.constraints!r} is not one of {', '.join(CONSTRAINTS)}")
        model = (
            resolve_model(self.model, parse_overrides(list(self.overrides)))
            if self.overrides
            else sim_model(self.model)
        )
        return SimSetup(
            model=model,
            trainer=TrainerSpec.parse(self.trainer),
            engine=EngineLayout.parse(self.engine, self.replicas),
            cluster=Cluster.parse(self.cluster),
            trainer_nodes=self.trainer_nodes,
            engine_nodes=self.engine_nodes,
            placement=self.placement,
            transport=self.transport,
            fanout=self.fanout,
            dtype=self.dtype,
            quantize_on=self.quantize_on,
            block=self.block,
            direct=self.direct,
            via_host=self.via_host,
            constraints=CONSTRAINTS[self.constraints],
            group_size=self.group_size,
            lookahead=self.lookahead,
            num_buffers=self.num_buffers,
            cold=self.cold,
            bucket_bytes=self.bucket_bytes,
            bucket_call=self.bucket_call,
            ep_gather=self.ep_gather,
            remote_host=self.remote_host,
            delta=parse_fractions(self.delta) if self.delta else None,
        )
