"""The trainer rank's host: its WeightSource, transport endpoint and serving side, behind typed commands."""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from typing import Any

from kvmove.errors import KvmoveError
from kvmove.models.checkpoint import engine_checkpoint
from kvmove.ports import free_port
from kvmove.sync.ranks.broadcast import KeptGroup, send_all
from kvmove.sync.ranks.control import (
    Address,
    ConnectPeers,
    EngineGone,
    Finish,
    ForgetEngine,
    HostBroadcastStore,
    OpenSlots,
    OpenSource,
    Pack,
    Packed,
    PickAddress,
    RegisterPulls,
    RunSync,
    SendBroadcast,
    StepWeights,
    TrainerEndpoint,
    TrainerHello,
    TrainerStats,
    TrainStep,
)
from kvmove.sync.ranks.host import Host, RankSpec, die_after, finished, handles, release_freed_memory
from kvmove.sync.ranks.source import SourceContext, WeightSource, seeded_source
from kvmove.sync.ranks.trainer import TrainerRank, open_trainer_rank


class TrainerHost(Host):
    """One trainer rank (see ``kvmove.sync.ranks.control`` for what each command does).

    ``source``: the rank's WeightSource, built by its framework (a rank hosted in the framework's own process);
    None: ``OpenSource`` builds it with the config's source factory.
    """

    def __init__(self, spec: RankSpec, source: WeightSource | None = None) -> None:
        super().__init__(spec)
        self.transport = self.open_transport()
        self._source: WeightSource | None = source
        self._serving: TrainerRank | None = None
        self._lock = threading.Lock()
        self._broadcast = KeptGroup()  # rank 0 hosts its store

    @property
    def source(self) -> WeightSource:
        if self._source is None:
            raise KvmoveError(f"trainer rank {self.spec.rank}: OpenSource first")
        return self._source

    @property
    def serving(self) -> TrainerRank:
        if self._serving is None:
            raise KvmoveError(f"trainer rank {self.spec.rank}: OpenSlots first")
        return self._serving

    @handles(PickAddress)
    def pick_address(self, _: PickAddress) -> Address:
        return Address(self.address.host, free_port(self.address.host))

    @handles(HostBroadcastStore)
    def host_broadcast_store(self, _: HostBroadcastStore) -> Address:
        return self._broadcast.host(self.address.host, self.config.deadline_s)

    @handles(OpenSource)
    def open_source(self, command: OpenSource) -> TrainerHello:
        c, s = self.config, self.spec
        if self._source is None:
            store, fmt = command.store, c.tensor_format
            ctx = SourceContext(c.model, c.trainer, s.rank, s.device, c.seed, store, c.deadline_s, fmt)
            self._source = (c.source or seeded_source)(ctx)
        self._source.warm({st.scope for st in c.strategies})  # NOTE: collective, like OpenSource itself
        return self.hello()

    def hello(self) -> TrainerHello:
        """Init step 1: this rank's process, control address, raw shards and arena."""
        arena = self.source.arena()
        shards = tuple(self.source.shards().items())
        return TrainerHello(self.spec.rank, os.getpid(), self.address, shards, arena[1] if arena is not None else None)

    @handles(OpenSlots)
    def open_slots(self, command: OpenSlots) -> TrainerEndpoint:
        s = self.spec
        self._serving, endpoint = open_trainer_rank(
            self.transport, self.source, command.sizes, s.rank, self.config.deadline_s, s.device
        )
        return endpoint

    @handles(ConnectPeers)
    def connect_peers(self, command: ConnectPeers) -> None:
        with self._lock:  # NOTE: a transport endpoint is used from one thread at a time
            for peer in command.peers:
                self.transport.connect(peer)

    @handles(RegisterPulls)
    def register_pulls(self, command: RegisterPulls) -> None:
        self.serving.register_pulls(command.strategy, command.engine, command.specs)

    @handles(ForgetEngine)
    def forget_engine(self, command: ForgetEngine) -> None:
        self.serving.forget_engine(command.engine)

    @handles(StepWeights)
    def step_weights(self, command: StepWeights) -> None:
        self.source.step(command.version)
        release_freed_memory()  # before the sync starts: the previous sync's and this step's temporaries

    @handles(TrainStep)
    def train_step(self, command: TrainStep) -> Any:
        return self.source.train(command.batch)

    @handles(RunSync)
    def run_sync(self, command: RunSync) -> TrainerStats:
        cpu = time.process_time()
        stats = self.serving.run_sync(command.sync, die_after(command.die_after_groups))
        return finished(stats, cpu)

    @handles(EngineGone)
    def engine_gone(self, command: EngineGone) -> None:
        self.serving.engine_gone(command.sync_id, command.engine)

    @handles(SendBroadcast)
    def send_broadcast(self, command: SendBroadcast) -> TrainerStats:
        cpu = time.process_time()
        pg = None
        if self.spec.rank == 0:
            pg = self._broadcast.get(command.group, 0, self.spec.device, self.config.deadline_s)
        # HF tensors are put in the engine's format here (an FP8 engine's quantized on rank 0); another format's
        # tensors cross as the trainer holds them, and the engine converts them (engine_host.receive_broadcast)
        convert = partial(engine_checkpoint, self.config.model) if self.config.tensor_format == "hf" else dict
        stats = send_all(self.source, self.spec.rank, pg, die_after(command.die_after_groups), convert)
        return finished(stats, cpu)

    # -- from engine ranks, by address ------------------------------------------------------------------------
    @handles(Pack)
    def pack(self, command: Pack) -> Packed:
        c = command
        return self.serving.pack(c.sync_id, c.strategy, c.engine, c.pull_id, c.timeout_s, c.dense)

    @handles(Finish)
    def finish(self, command: Finish) -> None:
        self.serving.note_read(command.strategy, command.slot, command.read_s)
        self.serving.release_slot(command.strategy, command.slot)
        self.serving.done(command.sync_id, command.group, command.engine)
