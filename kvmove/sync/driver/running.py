"""The ranks of one run, started by a launcher, after the five-step init; engine replicas drop out and rejoin.

Init: (1) trainer ranks build their WeightSource and report the shards they hold, checked against the layout;
(2) the trainer ranks' control addresses and endpoints reach the engine ranks (in each ``PullerInit``); (3) each
engine rank dry-runs its own loader into a plan; (4) the blueprint maps regions to source trainer ranks,
balanced; (5) both sides allocate and register their buffers once, and engine ranks open their pullers.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import NamedTuple

from kvmove.engines import get_engine
from kvmove.errors import KvmoveError, PlanError
from kvmove.models.tensors import TensorMeta
from kvmove.ports import free_port
from kvmove.sync.config import Side, SyncConfig
from kvmove.sync.launchers.base import Launcher, RankHandle
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.direct import ArenaLayout, check_arena
from kvmove.sync.planning.formats import get_format
from kvmove.sync.planning.ownership import DeclaredOwnership
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.ranks.control import (
    BroadcastGroup,
    BuildPlan,
    ConnectPeers,
    ForgetEngine,
    HostBroadcastStore,
    MeasureCopy,
    OpenPuller,
    OpenSlots,
    OpenSource,
    PickAddress,
    PlanReport,
    PullerInit,
    RankMemory,
    RegisterPulls,
    ReportMemory,
    TrainerHello,
    TrainerLink,
)
from kvmove.sync.ranks.host import Host, RankSpec
from kvmove.sync.ranks.trainer_host import TrainerHost
from kvmove.transport import Membership, get_transport

INIT_TIMEOUT_S = 900.0
"""Init steps may start engines (a vLLM takes tens of seconds); every sync wait has the run's own deadline."""


class RunningRanks:
    """See the module docstring; ``engines[e]`` is engine rank e's current handle (replaced when it rejoins)."""

    def __init__(self, config: SyncConfig, launcher: Launcher) -> None:
        self.config, self.launcher = config, launcher
        self.authkey = secrets.token_bytes(32)
        self.transport = get_transport(config.transport)
        self._group_port = free_port() if self.transport.group_member else 0
        self.engine_host: type[Host] = get_engine(config.engine_kind).host_class()
        tl, el = config.trainer, config.engine
        ranks = [(TrainerHost, self._spec(Side.TRAINER, r)) for r in range(tl.world)]
        ranks += [(self.engine_host, self._spec(Side.ENGINE, e)) for e in range(el.world)]
        self.dead: set[int] = set()
        self._broadcast: BroadcastGroup | None = None
        """The broadcast baseline's group while its ranks keep it; dropped when a replica is killed or restarted."""
        self.synced: dict[int, int] = {}
        """Engine rank -> the sync whose weights it holds (a delta sync diffs against it); absent: unknown."""
        self.notes: list[str] = []
        try:
            started = launcher.start(ranks)
            self.trainers, self.engines = started[: tl.world], started[tl.world :]
            launcher.started(started)
            self._init()
        except BaseException:  # a failed init leaves no rank (and no registered buffer) behind
            self.close()
            raise

    def _spec(self, side: Side, rank: int) -> RankSpec:
        c, p = self.config, self.config.placement
        device = p.trainer_device(rank) if side is Side.TRAINER else p.engine_device(rank)
        member = rank if side is Side.TRAINER else c.trainer.world + rank
        membership = None
        if self.transport.group_member:
            world = c.trainer.world + c.engine.world
            membership = Membership(member, world, "127.0.0.1", self._group_port, c.deadline_s + 60)
        bind = "127.0.0.1" if p.loopback else None
        return RankSpec(side, rank, c, device, self.authkey, bind, membership)

    # -- init -------------------------------------------------------------------------------------------------
    def _init(self) -> None:
        c, call = self.config, self.launcher.call
        (store,) = call(self.trainers[:1], PickAddress(), INIT_TIMEOUT_S)
        hellos: list[TrainerHello] = call(self.trainers, OpenSource(store), INIT_TIMEOUT_S)
        declared = check_ownership(c, hellos)
        direct = declared.arenas is not None
        if not direct and c.options.direct:
            self.notes.append("a trainer rank's source has no arena: every region is packed (no direct pulls)")
        self.tensors, self.ownership = declared.tensors, declared.ownership
        self.controls = {h.rank: h.control for h in hellos}
        self.plans = self._build_plans(range(c.engine.world))
        options = c.options if direct or not c.options.direct else replace(c.options, direct=False)
        devices = DeviceMap.of(c.placement, c.trainer.world, c.engine.world)
        self.blueprint = Blueprint(
            c.model,
            c.trainer,
            c.engine,
            self.plans,
            c.strategies,
            options,
            self.tensors,
            self.ownership,
            declared.arenas,
            devices=devices,
            strided=self.transport.strided,
            mapped=self.transport.maps_peers,
        )
        sizes = self.blueprint.slot_sizes()
        slots = [t.submit(OpenSlots(sizes[r])) for r, t in enumerate(self.trainers)]
        self.endpoints = dict(enumerate(self.launcher.gather(slots, INIT_TIMEOUT_S)))
        self._open_pullers(range(c.engine.world))
        nbytes = (1 << 30) if c.placement.engine_device(0).startswith("cuda") else (64 << 20)
        copy = MeasureCopy(c.placement.trainer_device(0), nbytes)
        (self.link_gbps,) = call(self.engines[:1], copy, INIT_TIMEOUT_S)

    def _build_plans(self, ranks: Iterable[int]) -> tuple[ShardingPlan, ...]:
        """Init step 3; engine replicas must agree on the plan of each local rank."""
        try:
            reports: list[PlanReport] = self.launcher.call(
                [self.engines[e] for e in ranks], BuildPlan(), INIT_TIMEOUT_S
            )
        except KvmoveError as exc:  # an engine that could not start: say why in one line
            raise KvmoveError(f"an engine rank failed to start: {exc}") from None
        self.plan_seconds = max(r.seconds for r in reports)
        known = {p.coord.local: p for p in getattr(self, "plans", ())}
        for report in reports:
            first = known.setdefault(report.plan.coord.local, report.plan)
            if first.regions != report.plan.regions:
                raise KvmoveError(f"engine replicas disagree on the plan of local rank {report.plan.coord.local}")
        return tuple(known[i] for i in sorted(known))

    def puller_init(self, engine: int) -> PullerInit:
        """What engine rank ``engine`` needs to pull, in any process (init step 2 reaches the engines here)."""
        c, bp = self.config, self.blueprint
        return PullerInit(
            engine=engine,
            transport=c.transport,
            trainers={t: TrainerLink(self.controls[t], ep) for t, ep in self.endpoints.items()},
            authkey=self.authkey,
            pulls={s: pps[engine] for s, pps in bp.pulls.items()},
            recv_sizes=bp.recv_sizes(engine),
            direct_params=tuple(bp.direct_params(engine)),
            deadline_s=c.deadline_s,
            membership=self._spec(Side.ENGINE, engine).membership,
        )

    def _open_pullers(self, ranks: Iterable[int]) -> None:
        """Init step 5 on the engine side, then what the trainer ranks need to serve those engine ranks."""
        bp, ranks = self.blueprint, list(ranks)
        calls = [self.engines[e].submit(OpenPuller(self.puller_init(e))) for e in ranks]
        infos = self.launcher.gather(calls, INIT_TIMEOUT_S)
        calls = [t.submit(ConnectPeers(tuple(infos))) for t in self.trainers] if self.transport.two_sided else []
        for s in bp.pulls:
            for e in ranks:
                calls += [self.trainers[t].submit(RegisterPulls(s, e, specs)) for t, specs in bp.specs(s, e).items()]
        self.launcher.gather(calls, INIT_TIMEOUT_S)

    # -- replicas ---------------------------------------------------------------------------------------------
    def replica_ranks(self, replica: int) -> list[int]:
        n = self.config.engine.ranks_per_replica
        return list(range(replica * n, (replica + 1) * n))

    def live_engines(self) -> list[int]:
        return [e for e in range(self.config.engine.world) if e not in self.dead]

    def dead_replicas(self) -> set[int]:
        return {self.config.engine.coord(e).replica for e in self.dead}

    def kill_replica(self, replica: int) -> None:
        self._broadcast = None
        for e in self.replica_ranks(replica):
            if e not in self.dead:
                self.engines[e].kill()
                self.dead.add(e)

    def restart_replica(self, replica: int) -> None:
        """A new process per rank of ``replica``, planned and connected again (it rejoins the next sync)."""
        ranks = self.replica_ranks(replica)
        self._broadcast = None
        self.launcher.gather([t.submit(ForgetEngine(e)) for t in self.trainers for e in ranks], INIT_TIMEOUT_S)
        started = self.launcher.start([(self.engine_host, self._spec(Side.ENGINE, e)) for e in ranks])
        for e, handle in zip(ranks, started, strict=True):
            self.engines[e] = handle
        self._build_plans(ranks)
        self._open_pullers(ranks)
        self.dead.difference_update(ranks)

    def broadcast_group(self, live: Sequence[int], sync_id: int) -> BroadcastGroup:
        """The broadcast baseline's group (trainer rank 0 and the ``live`` engine ranks, in order): named at the first
        broadcast sync and again only after a replica was lost, killed or restarted (the only ways the live ranks
        change), so the other syncs broadcast over the group their ranks keep open
        (``kvmove.sync.ranks.broadcast.KeptGroup``), as an RL framework's weight-update group is set up once."""
        if self._broadcast is None:
            (store,) = self.launcher.call(self.trainers[:1], HostBroadcastStore(), self.config.deadline_s)
            self._broadcast = BroadcastGroup(store, 1 + len(live), f"bcast-{sync_id}")
        return self._broadcast

    def live_ranks(self) -> list[RankHandle]:
        return [*self.trainers, *(self.engines[e] for e in self.live_engines())]

    def memory(self) -> list[RankMemory]:
        """Resident memory of every live rank's process (a soak records it sync after sync)."""
        return list(self.launcher.call(self.live_ranks(), ReportMemory(), self.config.deadline_s))

    def close(self) -> None:
        """End every rank of this run (engine ranks first); idempotent."""
        self.launcher.close()


class Declared(NamedTuple):
    """What init step 1 learns from the trainer ranks: the source's tensors, who holds which shard, and the
    arenas direct pulls read (None when some rank offers no arena: every region is then packed)."""

    tensors: list[TensorMeta]
    ownership: DeclaredOwnership
    arenas: dict[int, ArenaLayout] | None


def check_ownership(config: SyncConfig, hellos: list[TrainerHello]) -> Declared:
    """Init step 1: the shards the trainer ranks report tile every tensor of the source's format (kvmove's own
    seeded source: exactly as the layout's rules place them), and each arena holds its rank's shards; else a
    KvmoveError naming the first problem."""
    fmt = get_format(config.tensor_format)
    tensors = fmt.tensors(config.model, config.trainer)
    if len(hellos) != config.trainer.world:
        raise KvmoveError(f"{len(hellos)} trainer ranks answered; the layout has {config.trainer.world}")
    got = {(hello.rank, name, box) for hello in hellos for name, box in hello.shards}
    if config.source is None:
        rules = fmt.ownership(config.model, config.trainer)
        want = {(h.rank, t.name, h.box) for t in tensors for h in rules.slices(t)}
        for rank, name, box in sorted(got ^ want, key=str)[:1]:
            verb = "holds" if (rank, name, box) in got else "does not hold"
            raise KvmoveError(
                f"trainer rank {rank} {verb} the shard {tuple(box.start)}..{tuple(box.stop)} of {name}, "
                "unlike the trainer layout"
            )
    known = {t.name for t in tensors}
    stray = sorted(name for _, name, _ in got if name not in known)
    if stray:
        raise KvmoveError(f"a trainer rank reports {stray[0]!r}, not a tensor of the {fmt.name} checkpoint")
    ownership = DeclaredOwnership({h.rank: dict(h.shards) for h in hellos}, config.trainer)
    try:
        ownership.check_tiles(tensors)
        for hello in hellos:
            if hello.arena is not None:
                check_arena(hello.arena, dict(hello.shards), tensors, hello.rank)
    except PlanError as exc:
        raise KvmoveError(str(exc)) from None
    arenas = {h.rank: h.arena for h in hellos if h.arena is not None}
    return Declared(tensors, ownership, arenas if len(arenas) == len(hellos) else None)
