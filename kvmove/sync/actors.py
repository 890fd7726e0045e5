"""Ray actors for trainer and engine ranks: thin shells over TrainerRank / EngineRank and a transport."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import ray
import torch

from kvmove.engines import get_engine
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.sync.broadcast import receive_all, send_all
from kvmove.sync.collectives import Collectives, free_port
from kvmove.sync.engine import ByteReader, EngineRank, EngineStats, TrainerEndpoint, open_engine_rank
from kvmove.sync.packing import SliceSpec
from kvmove.sync.plan import ShardingPlan, plan_rank
from kvmove.sync.schedule import PullPlan
from kvmove.sync.source import ShardedSource
from kvmove.sync.trainer import TrainerRank, TrainerStats, TrainerSync, open_trainer_rank
from kvmove.sync.verify import bits_equal, seeded_checkpoint
from kvmove.transport import ACTOR_OPTIONS, BufferDesc, EndpointInfo, ServesSlots, Transport, get_transport


def _node_ip(loopback: bool) -> str:
    if loopback:
        return "127.0.0.1"
    ip = ray.util.get_node_ip_address()
    return "127.0.0.1" if ip in ("", "0.0.0.0") else ip


def _make_transport(name: str, options: dict[str, Any]) -> Transport:
    return get_transport(name)(**options)


def _gloo_group(host: str, port: int, rank: int, size: int, prefix: str, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout, wait_for_workers=False)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return store, dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


@ray.remote(**ACTOR_OPTIONS)
class TrainerActor(ServesSlots):
    """One trainer rank: its shards (a ShardedSource), gloo collectives, registered serve slots."""

    def __init__(
        self, cfg: ModelConfig, layout: TrainerLayout, rank: int, seed: int, transport: str, options: dict[str, Any]
    ) -> None:
        torch.set_num_threads(1)
        self.cfg, self.layout, self.rank, self.seed = cfg, layout, rank, seed
        self.transport = _make_transport(transport, options)
        self.impl: TrainerRank | None = None
        self.source: ShardedSource | None = None
        self._bcast_store: Any = None

    def address(self, loopback: bool) -> tuple[str, int]:
        """A host and free port on this actor's node (loopback for a local run)."""
        host = _node_ip(loopback)
        return host, free_port(host)

    def init_collectives(self, host: str, port: int, timeout_s: float) -> int:
        coll = Collectives(self.rank, self.layout.world, host, port, timeout_s)
        self.source = ShardedSource(self.cfg, self.layout, self.rank, coll, self.seed)
        return os.getpid()

    def ownership(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """Init step 1: (name, box start, box stop) of every shard this rank holds."""
        assert self.source is not None
        return [(n, b.start, b.stop) for n, b in self.source._boxes.items()]

    def setup_slots(self, sizes: dict[str, tuple[int, int]]) -> TrainerEndpoint:
        """Init step 5: allocate and register ``count`` slots of ``nbytes`` per strategy, and the arena, once."""
        assert self.source is not None
        self.impl, endpoint = open_trainer_rank(self.transport, self.source, sizes)
        return endpoint

    def connect(self, peers: list[EndpointInfo]) -> None:
        for peer in peers:
            self.transport.connect(peer)

    def register_pulls(self, strategy: str, engine: int, pulls: dict[int, tuple[int, tuple[SliceSpec, ...]]]) -> None:
        assert self.impl is not None
        self.impl.register_pulls(strategy, engine, pulls)

    def forget_engine(self, engine: int) -> None:
        assert self.impl is not None
        self.impl.forget_engine(engine)

    def prepare(self, version: int) -> None:
        """A stand-in optimizer step: the weights of training step ``version``."""
        assert self.source is not None
        self.source.set_version(version)

    def run_sync(self, sync: TrainerSync) -> TrainerStats:
        assert self.impl is not None
        return self.impl.run_sync(sync)

    def pack(self, sync_id: int, strategy: str, engine: int, pull_id: int, timeout_s: float) -> tuple[int, int]:
        assert self.impl is not None
        return self.impl.pack(sync_id, strategy, engine, pull_id, timeout_s)

    def finish(self, sync_id: int, strategy: str, group: int, engine: int, slot: int) -> None:
        assert self.impl is not None
        self.impl.release_slot(strategy, slot)
        self.impl.done(sync_id, group, engine)

    def engine_gone(self, sync_id: int, engine: int) -> None:
        assert self.impl is not None
        self.impl.engine_gone(sync_id, engine)

    def broadcast_sync(self, host: str, port: int, size: int, prefix: str, timeout_s: float) -> TrainerStats:
        """Baseline: gather every tensor onto rank 0, which broadcasts it to every live engine rank."""
        assert self.source is not None
        pg = None
        if self.rank == 0:
            self._bcast_store, pg = _gloo_group(host, port, 0, size, prefix, timeout_s)
        return send_all(self.source, pg)


@ray.remote(**ACTOR_OPTIONS)
class EngineActor(ServesSlots):
    """One engine rank: the engine's model (its real parameters), its plan and registered receive slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: EngineLayout,
        rank: int,
        transport: str,
        options: dict[str, Any],
        engine_kind: str,
    ) -> None:
        torch.set_num_threads(1)
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.coord = layout.coord(rank)
        self.adapter = get_engine(engine_kind)
        self.transport = _make_transport(transport, options)
        self.model = self.adapter.build(cfg, layout, self.coord)
        self.impl: EngineRank | None = None
        self.plan: ShardingPlan | None = None
        self._trainers: dict[int, Any] = {}
        self._endpoints: dict[int, TrainerEndpoint] = {}
        self._recv: dict[str, list[BufferDesc]] = {}
        self._params: dict[str, BufferDesc] = {}
        self._pulls: dict[str, PullPlan] = {}

    def pid(self) -> int:
        return os.getpid()

    def build_plan(self) -> tuple[ShardingPlan, float]:
        """Init step 3: dry-run this engine's own loader over recording tensors."""
        t0 = time.perf_counter()
        self.plan = plan_rank(self.cfg, self.layout, self.coord, engine=self.adapter)
        return self.plan, time.perf_counter() - t0

    def setup(
        self,
        pulls: dict[str, PullPlan],
        recv_sizes: dict[str, tuple[int, int]],
        direct_params: list[str],
        trainers: dict[int, Any],
        trainer_info: dict[int, TrainerEndpoint],
    ) -> EndpointInfo:
        """Init step 5 on the engine side: register receive slots and the parameters direct pulls write, once;
        connect to every source trainer."""
        assert self.plan is not None
        side = open_engine_rank(self.transport, self.model, self.plan, recv_sizes, direct_params, trainer_info)
        self.impl, self._recv, self._params = side
        self._pulls, self._trainers, self._endpoints = pulls, trainers, dict(trainer_info)
        return self.transport.endpoint_info()

    def run_sync(self, sync_id: int, strategy: str, pipelined: bool, delay_s: float, timeout_s: float) -> EngineStats:
        assert self.impl is not None
        client = ActorClient(self, strategy, timeout_s)
        return self.impl.run_sync(
            sync_id, strategy, self._pulls[strategy], client, pipelined=pipelined, delay_s=delay_s
        )

    def broadcast_receive(
        self, host: str, port: int, group_rank: int, size: int, prefix: str, timeout_s: float
    ) -> EngineStats:
        """Baseline: receive every full tensor (the whole model), then run the engine's loader over them."""
        _, pg = _gloo_group(host, port, group_rank, size, prefix, timeout_s)
        return receive_all(self.cfg, pg, self.adapter, self.model, self.rank)

    def verify(self, version: int, seed: int) -> tuple[bool, list[str]]:
        """Bit-exact check against this engine's own loader fed the full checkpoint of ``version``."""
        ref = self.adapter.build(self.cfg, self.layout, self.coord)
        self.adapter.load_weights(ref, seeded_checkpoint(self.cfg, seed, version).items())
        want = dict(ref.named_parameters())
        bad = [n for n, p in self.model.named_parameters() if not bits_equal(p.data, want[n].data)]
        return not bad, bad

    def hostname(self) -> str:
        return socket.gethostname()


class ActorClient(ByteReader):
    """TrainerClient over Ray actor calls (control) and the transport (bytes)."""

    def __init__(self, actor: EngineActor, strategy: str, timeout_s: float) -> None:
        super().__init__(actor.transport, actor._endpoints, actor._recv, actor._params, strategy)
        self.a, self.timeout_s = actor, timeout_s

    def request(self, trainer: int, sync_id: int, pull_id: int) -> Any:
        return self.a._trainers[trainer].pack.remote(sync_id, self.strategy, self.a.rank, pull_id, self.timeout_s)

    def wait(self, handle: Any) -> tuple[int, int]:
        slot, nbytes = ray.get(handle, timeout=self.timeout_s + 5)
        return int(slot), int(nbytes)

    def finish(self, trainer: int, sync_id: int, group: int, slot: int) -> None:
        self.a._trainers[trainer].finish.remote(sync_id, self.strategy, group, self.a.rank, slot)
