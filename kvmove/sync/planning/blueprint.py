"""The sync blueprint (pure planning): everything a driver derives from the engine plans before any byte moves.

Per strategy: the groups, each engine rank's pull plan (packed or direct), the pack specs each trainer rank
caches, the sizes of the trainer's serve slots and of the engine's receive slots, and each trainer rank's loop
for one sync. The driver builds one from the plans its engine ranks report (and the dry run from plans it makes
itself), so no two places can disagree on who sends what.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.sync.config import SyncOptions
from kvmove.sync.planning.ceiling import LinkBytes, link_bytes
from kvmove.sync.planning.direct import ArenaLayout, DirectPlanner
from kvmove.sync.planning.ownership import Owners, Ownership
from kvmove.sync.planning.packing import ServeSpec, pack_layout
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.planning.routing import route
from kvmove.sync.planning.schedule import Pull, PullPlan, consumers, gathered_names, packed, pull_plans, tensor_groups
from kvmove.sync.strategies import Strategy

SERVE_SLOTS = 4
MIN_BUFFER = 16

PullSpecs = dict[int, tuple[int, tuple[ServeSpec, ...]]]
"""pull id -> (group, serve specs): what a trainer rank caches to pack one engine rank's pulls."""


class Blueprint:
    """Pull plans and buffer sizes of every strategy of one run (see module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        trainer: TrainerLayout,
        engine: EngineLayout,
        plans: Sequence[ShardingPlan],
        strategies: Sequence[Strategy],
        options: SyncOptions,
        tensors: Sequence[TensorMeta] | None = None,
        ownership: Owners | None = None,
        arenas: Mapping[int, ArenaLayout] | None = None,
        *,
        devices: DeviceMap | None = None,
        strided: bool = False,
        mapped: bool = False,
    ) -> None:
        """``tensors``, ``ownership``, ``arenas``: the source's tensors, who holds them and its arenas as the
        trainer ranks declared them (defaults: the HF checkpoint's tensors placed by Megatron's rules);
        ``devices``: where ranks share devices (routing prefers those reads); ``strided``: the transport runs 2-D
        copies (``Transport.strided``), so regions of short rows may still be read directly; ``mapped``: the
        transport maps a peer's registered buffers (``Transport.maps_peers``), so an engine rank on a trainer
        rank's device quantizes the covers it would pull packed from that rank straight from its arena (mapped
        pulls: ``schedule.pull_plans``)."""
        self.cfg, self.trainer, self.engine, self.plans, self.options = cfg, trainer, engine, tuple(plans), options
        self.devices = devices
        tensors = hf_tensors(cfg) if tensors is None else list(tensors)
        self.shapes = {t.name: t.shape for t in tensors}
        self.ownership: Owners = Ownership(cfg, trainer) if ownership is None else ownership
        self.direct = DirectPlanner(self.ownership, tensors, arenas, strided) if options.direct else None
        self.strategies = {s.name: s for s in strategies if s.pulls}
        self.pulls: dict[str, tuple[PullPlan, ...]] = {}
        self.groups: dict[str, dict[int, list[str]]] = {}
        self.needed: dict[str, set[str]] = {}
        memo: dict[Hashable, Any] = {}  # entries shared by strategies that gather and read alike
        for s in self.strategies.values():
            groups = tensor_groups(cfg, trainer, s, options, tensors, self.ownership.stage_of)
            direct = self.direct if s.direct else None
            smap = route(self.plans, engine, self.ownership, s, direct, devices, tensors=tensors, memo=memo)
            self.pulls[s.name] = pull_plans(self.plans, engine, smap, groups, direct, self._maps(mapped))
            self.groups[s.name] = {g: [t.name for t in ts] for g, ts in groups.items()}
            self.needed[s.name] = gathered_names(self.pulls[s.name])
        self.held: dict[int, set[str]] = {r: set() for r in range(trainer.world)}
        for t in tensors:
            for h in self.ownership.slices(t):
                self.held[h.rank].add(t.name)

    def _maps(self, mapped: bool) -> Callable[[int, int], bool] | None:
        """Whether an engine rank quantizes a trainer rank's covers from its mapped arena: on one device only (across
        a link the BF16 bytes it would read are twice the FP8 ones a packed pull moves)."""
        devices = self.devices
        return devices.is_local if mapped and devices is not None else None

    def mapped_bytes(self, strategy: str) -> int:
        """FP8 bytes engine ranks quantize themselves from mapped arenas (mapped pulls) under ``strategy``."""
        return sum(p.nbytes for pp in self.pulls.get(strategy, ()) for p in pp.pulls if p.mapped)

    def plan_of(self, engine: int) -> ShardingPlan:
        return self.plans[self.engine.coord(engine).local]

    def pull_bytes(self, pull: Pull, pull_plan: PullPlan) -> int:
        """Bytes of a packed pull's payload (aligned as packed)."""
        assert pull_plan.plan is not None
        return pack_layout([n for i in pull.entries for n in pull_plan.plan.entries[i].sizes]).nbytes

    def specs(self, strategy: str, engine: int) -> dict[int, PullSpecs]:
        """Per trainer rank: the specs of the packed pulls engine ``engine`` will request under ``strategy``."""
        plan, pull_plan = self.plan_of(engine), self.pulls[strategy][engine]
        assert pull_plan.plan is not None
        out: dict[int, PullSpecs] = defaultdict(dict)
        for i, p in packed(pull_plan):
            entries = [pull_plan.plan.entries[k] for k in p.entries]
            specs = tuple(ServeSpec.of(e, plan, pull_plan.plan, self.shapes[e.tensor]) for e in entries)
            out[p.trainer][i] = (p.group, specs)
        return dict(out)

    def slot_sizes(self) -> list[dict[str, tuple[int, int]]]:
        """Per trainer rank and strategy: (slot count, slot bytes) of its registered serve slots."""
        sizes: list[dict[str, tuple[int, int]]] = [{} for _ in range(self.trainer.world)]
        for s, pps in self.pulls.items():
            for t in range(self.trainer.world):
                mine = [(p, pp) for pp in pps for _, p in packed(pp) if p.trainer == t]
                biggest = max((self.pull_bytes(p, pp) for p, pp in mine), default=MIN_BUFFER)
                count = self.strategies[s].serve_slots(len({pp.engine for _, pp in mine}), SERVE_SLOTS)
                sizes[t][s] = (count, max(biggest, MIN_BUFFER))
        return sizes

    def recv_sizes(self, engine: int) -> dict[str, tuple[int, int]]:
        """Per strategy: (slot count, slot bytes) of engine rank ``engine``'s receive slots (none if all direct)."""
        out = {}
        for s, pps in self.pulls.items():
            mine = [p for _, p in packed(pps[engine])]
            n = max((self.pull_bytes(p, pps[engine]) for p in mine), default=MIN_BUFFER)
            out[s] = (self.strategies[s].recv_slots() if mine else 0, max(n, MIN_BUFFER))
        return out

    def direct_params(self, engine: int) -> list[str]:
        """Parameters of engine rank ``engine`` that some direct pull writes (to register with the transport)."""
        return sorted({name for pps in self.pulls.values() for p in pps[engine].pulls for name, _ in p.direct})

    def direct_bytes(self, strategy: str) -> int:
        return sum(p.nbytes for pp in self.pulls.get(strategy, ()) for p in pp.pulls if p.direct)

    def packed_bytes(self, strategy: str) -> int:
        return sum(p.nbytes for pp in self.pulls.get(strategy, ()) for p in pp.pulls if p.packed)

    def link_bytes(self, strategy: str, engines: Sequence[int] | None = None) -> LinkBytes | None:
        """The payload of ``strategy`` split by device and link direction (None without a device map)."""
        if self.devices is None or strategy not in self.pulls:
            return None
        return link_bytes(self.pulls[strategy], self.devices, engines)

    def trainer_syncs(self, strategy: Strategy, sync_id: int, version: int, live: set[int]) -> list[TrainerSync]:
        """Each trainer rank's loop for one sync: the groups it materializes (only tensors some packed pull reads from
        a gathered tensor) or serves from its raw shards, and the live consumers of each."""
        needed = self.needed[strategy.name]
        lookahead = strategy.lookahead(self.options.lookahead)
        out = []
        for r in range(self.trainer.world):
            cons = {g: frozenset(es & live) for g, es in consumers(self.pulls[strategy.name], r).items()}
            groups = []
            for g, names in self.groups[strategy.name].items():
                mine = tuple(n for n in names if n in needed and (strategy.scope.every_rank_joins or n in self.held[r]))
                if mine or g in cons:  # NOTE: a group served only from raw shards is published with nothing gathered
                    groups.append((g, mine))
            out.append(TrainerSync(sync_id, version, strategy, tuple(groups), cons, lookahead))
        return out


@dataclass(frozen=True)
class TrainerSync:
    """What one trainer rank does in one sync (built by the blueprint from the strategy and routing)."""

    sync_id: int
    version: int
    strategy: Strategy
    groups: tuple[tuple[int, tuple[str, ...]], ...]
    """(group, tensor names this rank materializes for it), in processing order."""
    consumers: dict[int, frozenset[int]]
    """group -> live engine ranks that pull something packed of it from this rank."""
    lookahead: int
    delta: dict[int, int] | None = None
    """Delta syncs (``kvmove.sync.delta``): engine rank -> the sync whose weights it holds, for the engine ranks a
    pull may be encoded against (an empty dict: a full sync that refreshes the images); None: dense, no images."""
