"""The sync driver: start trainer and engine ranks as Ray actors, run the five-step init, then syncs.

Init: (1) trainer ranks report their shard ownership, checked against the metadata; (2) the metadata and the
trainer actors reach the engine ranks; (3) each engine rank dry-runs its own loader into a plan; (4) regions
are mapped to source trainer ranks, balanced; (5) both sides allocate and register transfer buffers once.
A sync is then: perturb the trainer weights, run every trainer's loop and every live engine's pulls, verify.
Dead engine replicas are skipped (their ranks are declared gone, so no trainer waits for them) and rejoin,
re-initialized, at the next sync.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import hf_tensors, model_totals
from kvmove.sync.blueprint import Blueprint
from kvmove.sync.ownership import Ownership
from kvmove.sync.plan import ShardingPlan
from kvmove.sync.schedule import SyncOptions
from kvmove.sync.strategies import Strategy
from kvmove.sync.trainer import TrainerSync
from kvmove.sync.verify import check_verifiable

TWO_SIDED = ("gloo", "rdt-gloo")
MEMORY_FRACTION = 0.6


@dataclass(frozen=True)
class Fault:
    """Kill engine replica ``replica`` at sync ``sync`` (before it starts, or ``during`` it)."""

    replica: int
    sync: int
    during: bool = False

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``REPLICA@SYNC`` (killed before that sync) or ``REPLICA@SYNC:mid`` (killed during it); syncs count from 1."""
        body, _, when = text.partition(":")
        replica, sep, sync = body.partition("@")
        try:
            if not sep or when not in ("", "mid"):
                raise ValueError
            return cls(int(replica), int(sync), when == "mid")
        except ValueError:
            raise KvmoveError(f"--fail-engine {text!r} is not REPLICA@SYNC or REPLICA@SYNC:mid") from None


@dataclass(frozen=True)
class SyncConfig:
    """Everything a run of syncs needs, built once at the CLI edge."""

    model: ModelConfig
    trainer: TrainerLayout
    engine: EngineLayout
    strategies: tuple[Strategy, ...]
    transport: str = "auto"
    syncs: int = 1
    verify: bool = False
    seed: int = 0
    options: SyncOptions = field(default_factory=SyncOptions)
    ray_address: str | None = None
    faults: tuple[Fault, ...] = ()
    slow_replicas: tuple[tuple[int, float], ...] = ()
    deadline_s: float = 60.0
    engine_kind: str = "reference"


class SyncResult(NamedTuple):
    strategy: str
    transport: str
    sync: int
    seconds: float
    bytes: int
    gbps: float
    transfer_gbps: float
    """Mean over engine ranks of bytes received / seconds spent in the transport's reads."""
    verified: bool | None
    engine_ranks: int
    trainer_ranks: int
    live_engines: int
    dead_replicas: tuple[int, ...]
    rejoined_replicas: tuple[int, ...]
    phases: dict[str, float]
    peak_extra_bytes: dict[str, int]
    bytes_per_engine_rank: tuple[int, ...]
    bytes_per_trainer_rank: tuple[int, ...]
    replica_seconds: dict[int, float]
    notes: tuple[str, ...]
    mismatched_ranks: tuple[int, ...] = ()
    """Engine ranks whose parameters differ from the loader's (``verified`` is False); ``verified`` is None when
    not checked, or when no engine rank was live to check."""

    def as_json(self) -> dict[str, Any]:
        out = self._asdict()
        out["seconds"] = round(self.seconds, 5)
        out["gbps"] = round(self.gbps, 5)
        out["transfer_gbps"] = round(self.transfer_gbps, 5)
        out["phases"] = {k: round(v, 5) for k, v in self.phases.items()}
        out["replica_seconds"] = {str(k): round(v, 5) for k, v in self.replica_seconds.items()}
        lists = ("dead_replicas", "rejoined_replicas", "bytes_per_engine_rank", "bytes_per_trainer_rank", "notes")
        for key in (*lists, "mismatched_ranks"):
            out[key] = list(out[key])
        return out


def start_ray(address: str | None) -> Any:
    """Join the Ray cluster at ``address``, or start a local one that stays on loopback."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not address:
        # NOTE: Ray resolves 127.0.0.1 to the machine's routable address unless it believes it runs on a
        # laptop; this flag (read by Ray's services at call time, and by the workers from the environment)
        # keeps a local run's every socket on loopback.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    if address:
        _probe(address)
    else:
        ray_constants.ENABLE_RAY_CLUSTER = False
    if ray.is_initialized():
        return ray
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # NOTE: "local" starts a new instance even where `ray start` left a cluster on this machine, which a
            # bare ray.init() would join (with num_cpus given, it refuses to)
            ray.init(
                address="local",
                num_cpus=max(2, os.cpu_count() or 2),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                configure_logging=False,
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise KvmoveError(f"cannot reach a Ray cluster at {address or 'local'}: {exc}".splitlines()[0]) from None
    return ray


def _probe(address: str) -> None:
    """Fail fast (seconds, not Ray's minutes of retries) when nothing listens at ``host:port``."""
    import socket

    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            pass
    except (OSError, ValueError) as exc:
        raise KvmoveError(f"cannot reach a Ray cluster at {address}: {exc}") from None


def check_memory(config: SyncConfig) -> None:
    """Refuse, before allocating anything, layouts whose ranks would not fit this machine's memory."""
    total = model_totals(config.model).total_bytes
    trainer = total  # shards over all trainer ranks plus, at most, one gathered copy per stage group
    engine = total * config.engine.replicas * 2  # parameters + (broadcast) a full model per replica's ranks
    if any(s.name == "broadcast" for s in config.strategies):
        engine += total * config.engine.world
    need = (
        trainer + engine + (total * config.trainer.world if any(s.scope == "global" for s in config.strategies) else 0)
    )
    have = available_memory()
    if need > have * MEMORY_FRACTION:
        raise KvmoveError(
            f"{config.model.name} ({total / 1e9:.2f} GB) over {config.trainer.world} trainer and "
            f"{config.engine.world} engine ranks needs about {need / 1e9:.1f} GB here; only "
            f"{have * MEMORY_FRACTION / 1e9:.1f} GB may be used ({have / 1e9:.1f} GB available). "
            "Use a smaller model or fewer ranks."
        )


def check_engine_kind(config: SyncConfig) -> None:
    """Refuse, before any actor starts, an unknown engine kind, a missing vLLM, or what vLLM engines lack here."""
    from kvmove.engines import get_engine

    get_engine(config.engine_kind)
    if config.engine_kind != "vllm":
        return
    from kvmove.engines.vllm import import_vllm
    from kvmove.engines.vllm.actor import check_layout

    import_vllm()
    check_layout(config.engine)
    if any(s.scope == "root" for s in config.strategies):
        raise KvmoveError("the broadcast baseline is not built for --engine-kind vllm (use v1, v2 or v3)")


def check_transport(name: str) -> str:
    """The transport that ``name`` resolves to, refused up front (naming its extra) if it cannot run here."""
    from kvmove.errors import MissingDependencyError
    from kvmove.transport import get_transport

    cls = get_transport(name)
    if not cls.is_available():
        hint = f"pip install 'kvmove[{cls.extra}]'" if cls.extra else "see the README's transport notes"
        raise MissingDependencyError(f"transport {cls.name!r} is not installed here: {hint}")
    return cls.name


def available_memory() -> int:
    """Bytes of memory available to new allocations on this machine (MemAvailable, else physical)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class Cluster:
    """The actors of one run and their init state; replicas can be killed and restarted."""

    def __init__(self, config: SyncConfig, ray: Any) -> None:
        from kvmove.sync.actors import EngineActor, TrainerActor
        from kvmove.transport import GlooGroup, create_rdt_group, get_transport

        self.config, self.ray = config, ray
        self.transport = get_transport(config.transport).name
        self._engine_cls: Any = EngineActor
        if config.engine_kind == "vllm":
            from kvmove.engines.vllm.actor import VllmEngineActor, check_layout

            check_layout(config.engine)
            self._engine_cls = VllmEngineActor
        cfg, tl, el = config.model, config.trainer, config.engine
        self._gloo = GlooGroup.local(tl.world + el.world) if self.transport == "gloo" else None
        opts = {"num_cpus": 0, "max_concurrency": 64}
        trainer_cls: Any = TrainerActor
        self.trainers = [
            trainer_cls.options(**opts).remote(cfg, tl, r, config.seed, self.transport, self._options(r))
            for r in range(tl.world)
        ]
        self.engines: list[Any] = [self._new_engine(e) for e in range(el.world)]
        if self.transport == "rdt-gloo":
            create_rdt_group([*self.trainers, *self.engines])
        self.dead: set[int] = set()
        try:
            host, port = ray.get(self.trainers[0].address.remote(config.ray_address is None))
            ray.get([t.init_collectives.remote(host, port, config.deadline_s) for t in self.trainers])
            self._check_ownership()
            self.plans = self._build_plans(range(el.world))
            self.blueprint = Blueprint(cfg, tl, el, self.plans, config.strategies, config.options)
            self.pulls = self.blueprint.pulls
            self.trainer_info = self._setup_trainers()
            for e in range(el.world):
                self._setup_engine(e)
        except BaseException:  # a failed init leaves no actor (and no registered buffer) behind
            self.close()
            raise

    def close(self) -> None:
        """Kill every actor of this run; idempotent."""
        for actor in (*self.engines, *self.trainers):
            self.ray.kill(actor, no_restart=True)

    # -- init -------------------------------------------------------------------------------------------------
    def _options(self, member: int) -> dict[str, Any]:
        return {"group": self._gloo.for_rank(member)} if self._gloo is not None else {}

    def _new_engine(self, rank: int) -> Any:
        c = self.config
        return self._engine_cls.options(num_cpus=0, max_concurrency=8).remote(
            c.model, c.engine, rank, self.transport, self._options(c.trainer.world + rank), c.engine_kind
        )

    def _check_ownership(self) -> None:
        reports = self.ray.get([t.ownership.remote() for t in self.trainers])
        want = Ownership(self.config.model, self.config.trainer)
        names = {t.name for t in hf_tensors(self.config.model)}
        held: set[str] = set()
        for rank, report in enumerate(reports):
            for name, start, _stop in report:
                held.add(name)
                if not any(
                    h.rank == rank and h.box.start == tuple(start) for h in want.slices(_meta(self.config.model, name))
                ):
                    raise KvmoveError(f"trainer rank {rank} reports a shard of {name} that the layout does not give it")
        if held != names:
            raise KvmoveError(f"no trainer rank holds {sorted(names - held)[:3]}")

    def _build_plans(self, ranks: range | list[int]) -> tuple[ShardingPlan, ...]:
        try:
            results = self.ray.get([self.engines[e].build_plan.remote() for e in ranks])
        except Exception as exc:  # an engine that could not start: say why in one line, not a Ray traceback
            raise KvmoveError(f"an engine rank failed to start: {_kvmove_cause(exc)}") from exc
        self.plan_seconds = max(s for _, s in results)
        by_local: dict[int, ShardingPlan] = {}
        for plan, _ in results:
            first = by_local.setdefault(plan.coord.local, plan)
            if first.regions != plan.regions:
                raise KvmoveError(f"engine replicas disagree on the plan of local rank {plan.coord.local}")
        return tuple(by_local[i] for i in sorted(by_local))

    def _setup_trainers(self) -> dict[int, Any]:
        sizes = self.blueprint.slot_sizes()
        infos = self.ray.get([t.setup_slots.remote(sizes[r]) for r, t in enumerate(self.trainers)])
        return dict(enumerate(infos))

    def _setup_engine(self, e: int) -> None:
        bp = self.blueprint
        pulls = {s: pps[e] for s, pps in self.pulls.items()}
        trainers = dict(enumerate(self.trainers))
        info = self.ray.get(
            self.engines[e].setup.remote(pulls, bp.recv_sizes(e), bp.direct_params(e), trainers, self.trainer_info)
        )
        calls = [t.connect.remote([info]) for t in self.trainers]
        for s in self.pulls:
            for t, specs in bp.specs(s, e).items():
                calls.append(self.trainers[t].register_pulls.remote(s, e, specs))
        self.ray.get(calls)

    # -- replicas ---------------------------------------------------------------------------------------------
    def replica_ranks(self, replica: int) -> list[int]:
        n = self.config.engine.ranks_per_replica
        return list(range(replica * n, (replica + 1) * n))

    def kill_replica(self, replica: int) -> None:
        for e in self.replica_ranks(replica):
            if e not in self.dead:
                self.ray.kill(self.engines[e], no_restart=True)
                self.dead.add(e)

    def restart_replica(self, replica: int) -> None:
        ranks = self.replica_ranks(replica)
        self.ray.get([t.forget_engine.remote(e) for t in self.trainers for e in ranks])
        for e in ranks:
            self.engines[e] = self._new_engine(e)
        self._build_plans(ranks)
        for e in ranks:
            self._setup_engine(e)
            self.dead.discard(e)

    def dead_replicas(self) -> set[int]:
        return {self.config.engine.coord(e).replica for e in self.dead}


def _kvmove_cause(exc: BaseException) -> str:
    """The KvmoveError message inside a Ray error (its text carries the remote traceback), else the error."""
    marker = "KvmoveError: "
    lines = [line for line in str(exc).splitlines() if marker in line]
    return lines[-1].split(marker, 1)[1] if lines else f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def _meta(cfg: ModelConfig, name: str) -> Any:
    return next(t for t in hf_tensors(cfg) if t.name == name)


def run_syncs(config: SyncConfig, progress: Callable[[str], None] | None = None) -> Iterator[SyncResult]:
    """Start the ranks, then run ``config.syncs`` syncs of each strategy; one result per (strategy, sync)."""
    if config.verify:
        check_verifiable(config.model)
    config.trainer.validate(config.model)
    config.engine.validate(config.model)
    check_memory(config)
    check_engine_kind(config)
    transport = check_transport(config.transport)
    if transport in TWO_SIDED and config.faults:
        raise KvmoveError(
            f"fault injection needs a transport a restarted replica can rejoin (nixl, rdt-nixl, object-store); "
            f"{transport} binds every rank into one fixed group"
        )
    ray = start_ray(config.ray_address)
    say = progress or (lambda _m: None)
    say(f"starting {config.trainer.world} trainer and {config.engine.world} engine ranks")
    cluster = Cluster(config, ray)
    version = 0
    sync_id = 0
    try:
        for strategy in config.strategies:
            for i in range(1, config.syncs + 1):
                version += 1
                sync_id += 1
                say(f"{strategy.name}: sync {i}/{config.syncs}")
                yield _one_sync(cluster, strategy, i, sync_id, version)
    finally:
        cluster.close()


def _one_sync(cluster: Cluster, strategy: Strategy, index: int, sync_id: int, version: int) -> SyncResult:
    from kvmove.sync.sync_step import run_one

    return run_one(cluster, strategy, index, sync_id, version)


def trainer_syncs(cluster: Cluster, strategy: Strategy, sync_id: int, version: int) -> list[TrainerSync]:
    """Each trainer rank's loop for this sync: its groups and the live consumers of each."""
    c = cluster.config
    live = set(range(c.engine.world)) - cluster.dead
    return cluster.blueprint.trainer_syncs(strategy, sync_id, version, live, c.deadline_s)
