"""Ray-free syncs: one ``torch.multiprocessing`` process per trainer and engine rank, each on its device.

The same trainer and engine ranks as the Ray path (TrainerRank, EngineRank, plans, routing, packing), driven
over pipes instead of actor calls, so the sync runs where Ray is not installed (the GPU machine): e.g. trainer
ranks on cuda:0 and engine ranks on cuda:1 with the ``cuda-ipc``, ``nccl`` or ``nixl`` transport. The broadcast
baseline uses an NCCL (GPU) or gloo (CPU) group of trainer rank 0 and every engine rank.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from kvmove.engines import get_engine
from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.sync.blueprint import Blueprint
from kvmove.sync.broadcast import receive_all, send_all
from kvmove.sync.collectives import Collectives, free_port
from kvmove.sync.engine import ByteReader, TrainerEndpoint, open_engine_rank
from kvmove.sync.plan import ShardingPlan, plan_rank
from kvmove.sync.runner import SyncResult
from kvmove.sync.schedule import PullPlan, SyncOptions
from kvmove.sync.source import ShardedSource
from kvmove.sync.strategies import Strategy
from kvmove.sync.sync_step import SyncContext, build_result
from kvmove.sync.trainer import TrainerRank, open_trainer_rank
from kvmove.sync.verify import verify_streaming
from kvmove.transport import Transport, get_transport
from kvmove.transport.gloo import GlooGroup
from kvmove.transport.nccl import NcclGroup


@dataclass(frozen=True)
class LocalConfig:
    """A Ray-free run: ranks are processes; ``*_devices`` are cycled over the ranks ("cpu", "cuda:0", ...)."""

    model: ModelConfig
    trainer: TrainerLayout
    engine: EngineLayout
    strategies: tuple[Strategy, ...]
    transport: str = "gloo"
    syncs: int = 1
    verify: bool = True
    seed: int = 0
    options: SyncOptions = field(default_factory=SyncOptions)
    trainer_devices: tuple[str, ...] = ("cpu",)
    engine_devices: tuple[str, ...] = ("cpu",)
    deadline_s: float = 300.0

    def trainer_device(self, rank: int) -> str:
        return self.trainer_devices[rank % len(self.trainer_devices)]

    def engine_device(self, rank: int) -> str:
        return self.engine_devices[rank % len(self.engine_devices)]


def _make_transport(name: str, member: int, world: int, port: int, device: str) -> Transport:
    if name == "nccl":
        from kvmove.transport.nccl import NcclTransport

        backend = "nccl" if device.startswith("cuda") else "gloo"
        return NcclTransport(group=NcclGroup(member, world, port=port), device=device, backend=backend)
    if name == "gloo":
        from kvmove.transport.gloo import GlooTransport

        return GlooTransport(group=GlooGroup(member, world, port=port))
    return get_transport(name)()


def _group(host: str, port: int, rank: int, size: int, prefix: str, device: str, timeout_s: float) -> tuple[Any, Any]:
    """A broadcast group over its own TCP store (rank 0 hosts it): NCCL for CUDA buffers, else gloo."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(prefix, store)
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return store, dist.ProcessGroupNCCL(prefixed, rank, size, options)
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return store, dist.ProcessGroupGloo(prefixed, rank, size, gloo)


def _serve_commands(conn: Any, handlers: dict[str, Callable[..., Any]]) -> None:
    """Answer ``(command, *args)`` messages with ``("ok", value)`` or ``("error", text)`` until "stop"."""
    while True:
        command, *args = conn.recv()
        if command == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[command](*args)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))


def _set_device(device: str) -> None:
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def _trainer_main(
    rank: int, config: LocalConfig, host: str, ports: tuple[int, int], ctrl: Any, engines: dict[int, Any]
) -> None:
    device = config.trainer_device(rank)
    _set_device(device)
    coll = Collectives(rank, config.trainer.world, host, ports[0], config.deadline_s, device=device)
    source = ShardedSource(config.model, config.trainer, rank, coll, config.seed, device=device)
    transport = _make_transport(config.transport, rank, config.trainer.world + config.engine.world, ports[1], device)
    state: dict[str, Any] = {}

    def setup_slots(sizes: dict[str, tuple[int, int]]) -> TrainerEndpoint:
        state["impl"], endpoint = open_trainer_rank(transport, source, sizes, device)
        for e, (packs, notes) in engines.items():
            threading.Thread(target=_serve_packs, args=(state["impl"], e, packs), daemon=True).start()
            threading.Thread(target=_serve_notes, args=(state["impl"], e, notes), daemon=True).start()
        return endpoint

    def broadcast(host_: str, port: int, size: int, prefix: str) -> Any:
        pg = _group(host_, port, 0, size, prefix, device, config.deadline_s)[1] if rank == 0 else None
        return send_all(source, pg)

    _serve_commands(
        ctrl,
        {
            "setup_slots": setup_slots,
            "connect": lambda infos: _connect_all(transport, infos),
            "register_pulls": lambda s, e, pulls: state["impl"].register_pulls(s, e, pulls),
            "prepare": source.set_version,
            "run_sync": lambda sync: state["impl"].run_sync(sync),
            "broadcast": broadcast,
        },
    )


def _connect_all(transport: Transport, infos: list[Any]) -> None:
    for info in infos:
        transport.connect(info)


def _serve_packs(impl: TrainerRank, engine: int, conn: Any) -> None:
    """One engine rank's pack requests to this trainer rank, answered in order: -> (slot, nbytes)."""
    while True:
        try:
            _, sync_id, strategy, pull_id, timeout_s = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", impl.pack(sync_id, strategy, engine, pull_id, timeout_s)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _serve_notes(impl: TrainerRank, engine: int, conn: Any) -> None:
    """One engine rank's "finish" notes (slot free, group done), on their own pipe: a pack waiting for its
    group must never hold up the note that releases an earlier group."""
    while True:
        try:
            _, sync_id, strategy, group, slot = conn.recv()
        except EOFError:
            return
        impl.release_slot(strategy, slot)
        impl.done(sync_id, group, engine)


class _PipeClient(ByteReader):
    """TrainerClient over pipes (control) and the transport (bytes)."""

    def __init__(self, pipes: dict[int, Any], reader: ByteReader, strategy: str, timeout_s: float):
        super().__init__(reader.transport, reader.trainers, reader.recv, reader.params, strategy)
        self.pipes, self.timeout_s = pipes, timeout_s

    def request(self, trainer: int, sync_id: int, pull_id: int) -> Any:
        self.pipes[trainer][0].send(("pack", sync_id, self.strategy, pull_id, self.timeout_s))
        return trainer

    def wait(self, handle: Any) -> tuple[int, int]:
        trainer = int(handle)
        pipe = self.pipes[trainer][0]  # NOTE: replies come back in request order on each trainer's pipe
        if not pipe.poll(self.timeout_s + 5):
            raise KvmoveError(f"trainer rank {trainer} did not answer within {self.timeout_s:.0f} s")
        status, value = pipe.recv()
        if status != "ok":
            raise KvmoveError(value)
        return int(value[0]), int(value[1])

    def finish(self, trainer: int, sync_id: int, group: int, slot: int) -> None:
        self.pipes[trainer][1].send(("finish", sync_id, self.strategy, group, slot))


def _engine_main(rank: int, config: LocalConfig, ports: tuple[int, int], ctrl: Any, trainers: dict[int, Any]) -> None:
    device = config.engine_device(rank)
    _set_device(device)
    layout, adapter = config.engine, get_engine("reference")
    coord = layout.coord(rank)
    model = adapter.build(config.model, layout, coord, device=device)
    world = config.trainer.world + layout.world
    transport = _make_transport(config.transport, config.trainer.world + rank, world, ports[1], device)
    state: dict[str, Any] = {}

    def plan() -> ShardingPlan:
        state["plan"] = plan_rank(config.model, layout, coord, engine=adapter)
        return state["plan"]

    def setup(
        pulls: dict[str, PullPlan],
        sizes: dict[str, tuple[int, int]],
        direct_params: list[str],
        infos: dict[int, TrainerEndpoint],
    ) -> Any:
        side = open_engine_rank(transport, model, state["plan"], sizes, direct_params, infos, device)
        state["impl"], state["pulls"] = side.rank, pulls
        state["reader"] = ByteReader(transport, infos, side.recv, side.params, "")
        return transport.endpoint_info()

    def run_sync(sync_id: int, strategy: str, pipelined: bool) -> Any:
        client = _PipeClient(trainers, state["reader"], strategy, config.deadline_s)
        stats = state["impl"].run_sync(sync_id, strategy, state["pulls"][strategy], client, pipelined=pipelined)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return stats

    def broadcast(host: str, port: int, group_rank: int, size: int, prefix: str) -> Any:
        _, pg = _group(host, port, group_rank, size, prefix, device, config.deadline_s)
        return receive_all(config.model, pg, adapter, model, rank, device)

    _serve_commands(
        ctrl,
        {
            "plan": plan,
            "info": transport.endpoint_info,
            "setup": setup,
            "run_sync": run_sync,
            "broadcast": broadcast,
            "verify": lambda version: verify_streaming(
                config.model, state["plan"], model, config.seed, version, device
            ),
        },
    )


class LocalCluster:
    """Processes of one Ray-free run, after the five-step init."""

    def __init__(self, config: LocalConfig) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        tl, el = config.trainer, config.engine
        self.host, ports = "127.0.0.1", (free_port(), free_port())
        packs = {(t, e): ctx.Pipe() for t in range(tl.world) for e in range(el.world)}
        notes = {(t, e): ctx.Pipe(duplex=False) for t in range(tl.world) for e in range(el.world)}
        self.trainers, self.engines, self.procs = [], [], []
        for t in range(tl.world):
            mine, theirs = ctx.Pipe()
            peers = {e: (packs[(t, e)][0], notes[(t, e)][0]) for e in range(el.world)}
            self.procs.append(ctx.Process(target=_trainer_main, args=(t, config, self.host, ports, theirs, peers)))
            self.trainers.append(mine)
        for e in range(el.world):
            mine, theirs = ctx.Pipe()
            peers = {t: (packs[(t, e)][1], notes[(t, e)][1]) for t in range(tl.world)}
            self.procs.append(ctx.Process(target=_engine_main, args=(e, config, ports, theirs, peers)))
            self.engines.append(mine)
        for p in self.procs:
            p.daemon = True
            p.start()
        self._init()

    def call(self, conns: list[Any], *message: Any) -> list[Any]:
        """Send one message to every conn, then collect every answer (the ranks work concurrently)."""
        return self.call_many([(c, message) for c in conns])

    def call_many(self, messages: list[tuple[Any, tuple[Any, ...]]]) -> list[Any]:
        for conn, message in messages:
            conn.send(message)
        out = []
        for conn, message in messages:
            if not conn.poll(self.config.deadline_s + 30):
                raise KvmoveError(f"a rank process did not answer {message[0]!r} in time")
            status, value = conn.recv()
            if status != "ok":
                raise KvmoveError(f"{message[0]} failed: {value}")
            out.append(value)
        return out

    def _init(self) -> None:
        c, el = self.config, self.config.engine
        plans = self.call(self.engines, "plan")
        self.plans = tuple(plans[i] for i in range(el.ranks_per_replica))
        bp = self.blueprint = Blueprint(c.model, c.trainer, el, self.plans, c.strategies, c.options)
        self.pulls = bp.pulls
        sizes = bp.slot_sizes()
        infos = self.call_many([(t, ("setup_slots", sizes[r])) for r, t in enumerate(self.trainers)])
        self.trainer_info = dict(enumerate(infos))
        engine_infos = self.call(self.engines, "info")
        setups = [
            (
                conn,
                (
                    "setup",
                    {s: p[e] for s, p in self.pulls.items()},
                    bp.recv_sizes(e),
                    bp.direct_params(e),
                    self.trainer_info,
                ),
            )
            for e, conn in enumerate(self.engines)
        ]
        two_sided = c.transport in ("nccl", "gloo")  # servers answer reads, so they connect to their readers too
        self.call_many(setups + ([(t, ("connect", engine_infos)) for t in self.trainers] if two_sided else []))
        for name in self.pulls:
            for e in range(el.world):
                for t, specs in bp.specs(name, e).items():
                    self.call([self.trainers[t]], "register_pulls", name, e, specs)

    def sync(self, strategy: Strategy, index: int, sync_id: int, version: int) -> SyncResult:
        c = self.config
        self.call(self.trainers, "prepare", version)
        start = time.perf_counter()
        if strategy.scope == "root":
            port, size = free_port(), 1 + c.engine.world
            for t in self.trainers:
                t.send(("broadcast", self.host, port, size, f"bcast-{sync_id}"))
            for e, conn in enumerate(self.engines):
                conn.send(("broadcast", self.host, port, 1 + e, size, f"bcast-{sync_id}"))
        else:
            syncs = self.blueprint.trainer_syncs(strategy, sync_id, version, set(range(c.engine.world)), c.deadline_s)
            for t, ts in zip(self.trainers, syncs, strict=True):
                t.send(("run_sync", ts))
            for conn in self.engines:
                conn.send(("run_sync", sync_id, strategy.name, strategy.name == "v3"))
        engine_stats, done_at = {}, {}
        for e, conn in enumerate(self.engines):
            engine_stats[e] = self._answer(conn, f"engine rank {e}")
            done_at[e] = time.perf_counter() - start
        trainer_stats = [self._answer(t, f"trainer rank {i}") for i, t in enumerate(self.trainers)]
        seconds = time.perf_counter() - start
        verified: bool | None = None
        mismatched: tuple[int, ...] = ()
        if c.verify:
            checks = self.call(self.engines, "verify", version)
            mismatched = tuple(e for e, (ok, _) in enumerate(checks) if not ok)
            verified = not mismatched
        backend = "nccl" if c.engine_device(0).startswith("cuda") else "gloo"
        ctx = SyncContext(c.engine, c.trainer.world, c.transport, broadcast_backend=backend)
        return build_result(
            ctx, strategy, index, seconds, verified, engine_stats, trainer_stats, done_at, [], mismatched
        )

    def _answer(self, conn: Any, who: str) -> Any:
        if not conn.poll(self.config.deadline_s + 30):
            raise KvmoveError(f"{who} did not finish the sync in time")
        status, value = conn.recv()
        if status != "ok":
            raise KvmoveError(f"{who} failed: {value}")
        return value

    def close(self) -> None:
        """Engines first: they hold mappings of the trainers' buffers, which must outlive them."""
        n = self.config.trainer.world
        for conns, procs in ((self.engines, self.procs[n:]), (self.trainers, self.procs[:n])):
            for conn in conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(("stop",))
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()


def run_local(config: LocalConfig, progress: Callable[[str], None] | None = None) -> Iterator[SyncResult]:
    """Start the rank processes, then ``config.syncs`` syncs per strategy; one result per (strategy, sync)."""
    config.trainer.validate(config.model)
    config.engine.validate(config.model)
    say = progress or (lambda _m: None)
    say(f"starting {config.trainer.world} trainer and {config.engine.world} engine rank processes")
    cluster = LocalCluster(config)
    try:
        version = sync_id = 0
        for strategy in config.strategies:
            for i in range(1, config.syncs + 1):
                version += 1
                sync_id += 1
                say(f"{strategy.name}: sync {i}/{config.syncs}")
                yield cluster.sync(strategy, i, sync_id, version)
    finally:
        cluster.close()
