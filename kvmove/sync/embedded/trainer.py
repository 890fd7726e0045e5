"""One trainer rank of a sync run from the framework's own processes (every trainer process builds one).

Init, in lockstep on every rank: rank 0 makes the run's key and opens the engine registry, then hands the engines
their join info through the framework's engine client (``init_weight_transfer_engine``); each engine rank
registers its plan. Rank 0 closes the registration into a fleet and every rank hosts its trainer rank
(``TrainerHost``, in this process) over its source; rank 0 checks what the ranks hold, derives the blueprint from
the registered plans, opens every rank's serve slots, caches the pack specs, publishes each engine rank's
``PullerInit`` and hands each trainer rank its sync loop.

A sync (:meth:`EmbeddedTrainer.sync`, every rank): each rank runs its loop in the calling thread (the source's
collectives run where the framework runs them) while engine ranks pull; rank 0 drives the engines with
``start_weight_update``, ``update_weights`` (concurrently with its loop) and ``finish_weight_update``. It returns
on every rank once the engines hold the new weights, or raises the same error on every rank.
"""

from __future__ import annotations

import dataclasses
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmove.errors import KvmoveError
from kvmove.models.layout import TrainerLayout
from kvmove.sync.config import Side, SyncConfig, SyncOptions
from kvmove.sync.driver.checks import delta_checked
from kvmove.sync.driver.running import check_ownership
from kvmove.sync.embedded.group import TrainerGroup
from kvmove.sync.embedded.member import JoinInfo, check_transport
from kvmove.sync.embedded.registry import EngineRegistry, Fleet
from kvmove.sync.embedded.source import IterableSource, data_parallel
from kvmove.sync.planning.blueprint import Blueprint, TrainerSync
from kvmove.sync.ranks.control import (
    EngineGone,
    OpenSlots,
    PullerInit,
    RegisterPulls,
    TrainerEndpoint,
    TrainerHello,
    TrainerLink,
    TrainerStats,
)
from kvmove.sync.ranks.host import RankSpec
from kvmove.sync.ranks.source import WeightSource
from kvmove.sync.ranks.trainer_host import TrainerHost
from kvmove.sync.ranks.wire import ControlClient
from kvmove.sync.strategies import parse_strategies

INIT_TIMEOUT_S = 900.0


class EngineClient(Protocol):
    """How the trainer reaches its inference engines: vLLM's four weight-sync calls (``VLLMWeightSyncClient``).
    Each call reaches every engine replica and returns once all are done; ``update_weights`` must run them
    concurrently (every replica pulls at once, from the same trainer groups)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


@dataclass(frozen=True)
class TrainerSettings:
    """How the trainer side syncs; identical on every rank."""

    strategy: str = "v3"
    transport: str = "nixl"
    device: str = "cpu"
    """Where this rank's serve slots live (and a framework source's tensors are put)."""
    host: str = "127.0.0.1"
    """Address this rank's control server and the engine registry listen on (engines must reach it)."""
    deadline_s: float = 60.0
    options: SyncOptions = field(default_factory=SyncOptions)
    layout: TrainerLayout | None = None
    """The trainer layout of a kvmove ``WeightSource`` (None for a framework's iterable source: data parallel)."""
    delta: bool = False
    """Delta syncs (``kvmove.sync.delta``): after a sync every engine finished, the next moves only changed words
    (a failed sync makes the next one full)."""


@dataclass(frozen=True)
class Given:
    """The ``SyncConfig.source`` of a rank hosted over a source its framework built (it is never rebuilt)."""

    source: WeightSource

    def __call__(self, _ctx: Any) -> WeightSource:
        return self.source


class EmbeddedTrainer:
    """Trainer rank ``rank`` (see the module docstring); ``source`` is a kvmove ``WeightSource`` (with
    ``settings.layout``) or a framework's re-iterable source (``kvmove.sync.embedded.source``)."""

    def __init__(self, rank: int, source: Any, client: EngineClient, settings: TrainerSettings) -> None:
        self.rank, self.client, self.settings = rank, client, settings
        (self.strategy,) = parse_strategies(settings.strategy)
        if not self.strategy.pulls:
            raise KvmoveError(f"strategy {self.strategy.name} does not pull; use v1, v2 or v3")
        self.transport = check_transport(settings.transport).name
        self.group = TrainerGroup(rank, INIT_TIMEOUT_S)
        self.registry: EngineRegistry | None = None
        self.host: TrainerHost | None = None
        self.count = 0
        self.completed = 0
        """The last sync every engine finished (delta syncs diff against it; 0: none)."""
        try:
            self._init(source)
        except BaseException:
            self.close()
            raise

    def _init(self, source: Any) -> None:
        self.authkey: bytes = self.group.broadcast(secrets.token_bytes(32) if self.rank == 0 else None)
        self.fleet: Fleet = self.group.agree(self._register_engines)
        config = self._config(source)
        self.source = (
            source if isinstance(source, WeightSource) else IterableSource(source, config.model, self.settings.device)
        )
        spec = RankSpec(
            Side.TRAINER, self.rank, config, self.settings.device, self.authkey, self.settings.host, owns_process=False
        )
        self.host = TrainerHost(spec, self.source)
        hellos = self.group.all_gather(self.host.hello())
        loops: list[TrainerSync] = self.group.agree(lambda: self._serve_engines(config, hellos))
        self.loop = loops[self.rank]

    def _register_engines(self) -> Fleet:
        """Rank 0: open the registry, hand the engines their join info, close the registration."""
        s = self.settings
        self.registry = EngineRegistry(self.authkey, s.host)
        address = self.registry.address
        join = JoinInfo(address.host, address.port, self.authkey.hex(), self.transport, s.deadline_s)
        self.client.init_weight_transfer_engine(join.payload())
        return self.registry.close()

    def _config(self, source: Any) -> SyncConfig:
        """The run's config; a kvmove ``WeightSource`` declares what each rank holds (its own shards, e.g. an
        FSDP2 model's), so the layout's placement rules are not imposed on it."""
        s, model = self.settings, self.fleet.model
        layout = s.layout or data_parallel(self.group.world)
        if layout.world != self.group.world:
            raise KvmoveError(
                f"trainer layout {layout.label()} has {layout.world} ranks, the trainer {self.group.world}"
            )
        layout.validate(model)
        return delta_checked(
            SyncConfig(
                model,
                layout,
                self.fleet.layout,
                (self.strategy,),
                self.transport,
                deadline_s=s.deadline_s,
                options=s.options,
                source=Given(source) if isinstance(source, WeightSource) else None,
                delta=s.delta,
            )
        )

    def _serve_engines(self, config: SyncConfig, hellos: list[TrainerHello]) -> list[TrainerSync]:
        """Rank 0: init steps 4-5 over the registered plans; every rank's sync loop."""
        declared = check_ownership(config, hellos)
        direct = declared.arenas is not None
        options = config.options if direct else dataclasses.replace(config.options, direct=False)
        c = config
        bp = Blueprint(
            c.model, c.trainer, c.engine, self.fleet.plans, c.strategies, options,
            declared.tensors, declared.ownership, declared.arenas,
        )  # fmt: skip
        self.peers = {
            h.rank: ControlClient(h.control, self.authkey, f"trainer rank {h.rank}", INIT_TIMEOUT_S) for h in hellos
        }
        sizes = bp.slot_sizes()
        endpoints: dict[int, TrainerEndpoint] = {t: c.call(OpenSlots(sizes[t])) for t, c in self.peers.items()}
        name = self.strategy.name
        for e in range(config.engine.world):
            for t, specs in bp.specs(name, e).items():
                self.peers[t].call(RegisterPulls(name, e, specs))
        controls = {h.rank: h.control for h in hellos}
        links = {t: TrainerLink(controls[t], ep) for t, ep in endpoints.items()}
        assert self.registry is not None
        for e, member in enumerate(self.fleet.members):
            init = PullerInit(
                e,
                self.transport,
                links,
                self.authkey,
                {name: bp.pulls[name][e]},
                bp.recv_sizes(e),
                tuple(bp.direct_params(e)),
                self.settings.deadline_s,
            )
            self.registry.publish(member.ticket, init)
        return bp.trainer_syncs(self.strategy, 0, 0, set(range(config.engine.world)))

    # -- syncs ------------------------------------------------------------------------------------------------
    def sync(self, weight_version: str | None = None) -> TrainerStats:
        """One sync on this rank (every trainer rank calls it, in lockstep); this rank's serving stats."""
        self.count += 1
        loop = dataclasses.replace(self.loop, sync_id=self.count, version=self.count, delta=self._delta_bases())
        assert self.host is not None
        failure: BaseException | None = None
        stats: TrainerStats | None = None
        self.source.step(self.count)
        try:
            stats = self._drive(loop, weight_version) if self.rank == 0 else self.host.serving.run_sync(loop)
        except Exception as exc:
            failure = exc
        finally:
            if isinstance(self.source, IterableSource):
                self.source.reset()  # what the pass read ahead is freed now, not at the next sync
        self.group.check(failure)
        self.completed = self.count
        assert stats is not None
        return stats

    def _delta_bases(self) -> dict[int, int] | None:
        """Delta syncs: every engine rank holds the last sync if it completed (else a full sync)."""
        if not self.settings.delta:
            return None
        if not self.completed or self.completed != self.count - 1:
            return {}
        return dict.fromkeys(range(self.fleet.layout.world), self.completed)

    def _drive(self, loop: TrainerSync, weight_version: str | None) -> TrainerStats:
        """Rank 0: start the engines' update, serve while they pull (``update_weights`` on a side thread), finish."""
        assert self.host is not None
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvmove-update")
        info = {"sync_id": loop.sync_id, "strategy": self.strategy.name}
        update = pool.submit(self.client.update_weights, info)
        update.add_done_callback(lambda f: self._abandon(loop.sync_id) if f.exception() else None)
        try:
            stats = self.host.serving.run_sync(loop)
            update.result()
        finally:
            pool.shutdown(wait=False)  # an engine stuck in its update must not hang the trainer here
        self.client.finish_weight_update(weight_version)
        return stats

    def _abandon(self, sync_id: int) -> None:
        """The engines' update failed: no trainer rank waits for their pulls any longer (their loops end now)."""
        for client in list(getattr(self, "peers", {}).values()):
            for e in range(self.fleet.layout.world):
                client.send(EngineGone(sync_id, e))
                client.receive()

    def close(self) -> None:
        """Release this rank's serving side, registry and connections (the engines keep serving); idempotent."""
        for client in getattr(self, "peers", {}).values():
            client.close()
        self.peers = {}
        if self.registry is not None:
            self.registry.shutdown()
            self.registry = None
        if self.host is not None:
            if self.host._serving is not None:
                self.host.transport.close()
            self.host.close()
            self.host = None
        self.group.destroy()
