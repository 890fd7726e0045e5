"""One trainer process of the RL loop, as an RL framework runs it: the FSDP2 policy, its optimizer, and kvmove's
trainer-side engine of vLLM's weight-transfer API (``WeightTransferTrainerFactory.trainer_init`` with
``KvmoveTrainerInitInfo``) serving this rank's shards.

The loop's driver holds the vLLM engines; trainer rank 0 reaches them through :class:`RemoteEngines`, a
``VLLMWeightSyncClient`` whose four calls travel to the driver over kvmove's authenticated control wire (as a
framework's trainer would call its engines' Ray handles or HTTP routes), where an ``EngineGroup`` runs each call
on every engine at once. The process is started by a kvmove launcher (plain process or Ray actor) and answers
:class:`JoinEngines` (build the policy, ``trainer_init``), ``TrainStep`` and :class:`SendWeights`
(``send_weights``: every rank serves while the engines pull).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.ports import free_port
from kvmove.sync.ranks.control import Address, Command, PickAddress, TrainerStats, TrainStep
from kvmove.sync.ranks.host import Host, RankSpec, handles, release_freed_memory
from kvmove.sync.ranks.source import SourceContext, WeightSource
from kvmove.sync.ranks.wire import ControlClient

CALLS = frozenset({"init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"})
"""The calls a trainer may make on the driver's engines (vLLM's weight-sync client protocol)."""


@dataclass(frozen=True)
class EngineCall(Command):
    """Trainer rank 0 -> the driver: one of vLLM's weight-sync calls on every engine (``method`` in CALLS)."""

    method: str
    args: tuple[Any, ...] = ()


class RemoteEngines:
    """A ``VLLMWeightSyncClient`` reaching the driver's engines at ``address`` (see the module docstring)."""

    def __init__(self, address: Address, authkey: bytes, timeout_s: float) -> None:
        self.address, self.authkey, self.timeout_s = address, authkey, timeout_s

    def _call(self, method: str, *args: Any) -> None:
        client = ControlClient(self.address, self.authkey, "the RL driver's vLLM engines", self.timeout_s)
        try:
            client.call(EngineCall(method, args), self.timeout_s)
        finally:
            client.close()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def answer_engine_call(engines: Any, command: Any) -> None:
    """The driver's side of :class:`RemoteEngines`: run ``command`` on ``engines`` (an ``EngineGroup``)."""
    if not isinstance(command, EngineCall) or command.method not in CALLS:
        raise KvmoveError(f"the RL driver's engines answer {sorted(CALLS)}, not {command!r}"[:300])
    getattr(engines, command.method)(*command.args)


@dataclass(frozen=True)
class JoinEngines(Command):
    """Build this rank's policy (``SyncConfig.source``) and its trainer engine; rank 0 hands the engines their
    init info through the driver at ``engines`` (collective: every rank at once) -> None."""

    store: Address
    """A TCP rendezvous for the trainer ranks' process group (trainer rank 0's ``PickAddress``)."""
    engines: Address
    strategy: str
    transport: str


@dataclass(frozen=True)
class SendWeights(Command):
    """One sync (every rank at once): the policy's current weights into every engine -> :class:`SendReport`."""

    version: int


class SendReport(NamedTuple):
    """One trainer rank's side of a sync."""

    version: int
    stats: TrainerStats


class RlTrainerHost(Host):
    """The RL loop's trainer process (see the module docstring)."""

    def __init__(self, spec: RankSpec) -> None:
        super().__init__(spec)
        self.source: WeightSource | None = None
        self.engine: Any = None

    @handles(PickAddress)
    def pick_address(self, _: PickAddress) -> Address:
        return Address(self.address.host, free_port(self.address.host))

    @handles(JoinEngines)
    def join_engines(self, command: JoinEngines) -> None:
        from kvmove.vllm.trainer import KvmoveTrainerEngine, KvmoveTrainerInitInfo

        c, s = self.config, self.spec
        if c.source is None:
            raise KvmoveError("the RL trainer needs a policy factory (SyncConfig.source)")
        ctx = SourceContext(c.model, c.trainer, s.rank, s.device, c.seed, command.store, c.deadline_s)
        self.source = c.source(ctx)
        info = KvmoveTrainerInitInfo(
            rank=s.rank, strategy=command.strategy, transport=command.transport, host=self.address.host,
            device=s.device, deadline_s=c.deadline_s, layout=c.trainer, delta=c.delta,
        )  # fmt: skip
        client = RemoteEngines(command.engines, s.authkey, c.deadline_s + 600)
        self.engine = KvmoveTrainerEngine.trainer_init(info, client=client, source=self.source)

    @handles(TrainStep)
    def train_step(self, command: TrainStep) -> Any:
        if self.source is None:
            raise KvmoveError(f"trainer rank {self.spec.rank}: JoinEngines first")
        report = self.source.train(command.batch)
        release_freed_memory()
        return report

    @handles(SendWeights)
    def send_weights(self, command: SendWeights) -> SendReport:
        if self.engine is None:
            raise KvmoveError(f"trainer rank {self.spec.rank}: JoinEngines first")
        self.engine.send_weights(weight_version=str(command.version))
        if self.engine.trainer.count != command.version:
            raise KvmoveError(
                f"trainer rank {self.spec.rank} synced version {self.engine.trainer.count}, asked for {command.version}"
            )
        return SendReport(command.version, self.engine.last_stats)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        super().close()
