"""A trainer rank during syncs: materialize groups, serve packed pulls from registered slots, release groups.

The sync loop (``run_sync``) gathers group after group, never holding more than ``lookahead + 1`` groups that
some live consumer still needs. Pulls (``pack``) arrive from engine ranks on other threads and wait until
their group is materialized. A group is released when every live engine rank that pulls from this rank has
signalled ``done`` for it; an engine declared gone (``engine_gone``) no longer counts, so a dead engine never
blocks the trainer. Every wait has a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvmove.errors import KvmoveError
from kvmove.sync.delta import warm as warm_delta
from kvmove.sync.delta.detect import Coded, Images
from kvmove.sync.planning.blueprint import PullSpecs, TrainerSync
from kvmove.sync.planning.direct import shard_views
from kvmove.sync.planning.packing import ServeSpec
from kvmove.sync.planning.plan import Box
from kvmove.sync.programs import Streams
from kvmove.sync.ranks.control import Packed, TrainerEndpoint, TrainerStats
from kvmove.sync.ranks.source import Gathered, WeightSource
from kvmove.sync.transforms import Held, PackProgram, pack_program
from kvmove.transport import Transport


class SyncTimeout(KvmoveError):
    """A sync made no progress before its deadline (a peer died or hung)."""


@dataclass
class _State:
    sync: TrainerSync
    held: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    extra: dict[int, int] = field(default_factory=dict)
    pending: dict[int, set[int]] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)
    failed: str = ""


def open_trainer_rank(
    transport: Transport,
    source: WeightSource,
    sizes: Mapping[str, tuple[int, int]],
    rank: int,
    deadline_s: float = 60.0,
    device: str = "cpu",
) -> OpenedTrainer:
    """Init step 5 on the trainer side, once: allocate and register ``count`` serve slots of ``nbytes`` per
    strategy, and the source's arena (if it has one) for direct pulls."""
    slots = {s: [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(k)] for s, (k, n) in sizes.items()}
    descs = {s: [transport.register(t) for t in ts] for s, ts in slots.items()}
    arena = source.arena()
    arena_desc = transport.register(arena[0]) if arena is not None else None
    return OpenedTrainer(
        TrainerRank(source, slots, rank, deadline_s), TrainerEndpoint(transport.endpoint_info(), descs, arena_desc)
    )


class OpenedTrainer(NamedTuple):
    """A trainer rank's serving side and the endpoint engine ranks read it through."""

    rank: TrainerRank
    endpoint: TrainerEndpoint


class TrainerRank:
    """Serving side of one trainer rank; thread-safe for concurrent ``pack``/``done`` calls."""

    def __init__(
        self, source: WeightSource, slots: Mapping[str, Sequence[torch.Tensor]], rank: int, deadline_s: float = 60.0
    ) -> None:
        self.source, self.rank, self.deadline_s = source, rank, deadline_s
        self.slots = {strategy: list(s) for strategy, s in slots.items()}
        self._free_slots = {strategy: list(range(len(s))) for strategy, s in self.slots.items()}
        self._slot_owner: dict[tuple[str, int], int] = {}
        self._slot_pull: dict[tuple[str, int], tuple[str, int, int]] = {}
        """The pull each slot was last packed with (whose read the engine's finish note times)."""
        self._pulls: dict[tuple[str, int, int], tuple[int, tuple[ServeSpec, ...]]] = {}
        self._shards = _raw_shards(source)
        self._cond = threading.Condition()
        self._state: _State | None = None
        self._extra = self._peak_extra = 0
        self._served = self._pulls_served = 0
        self._pack_seconds = 0.0
        self._programs: dict[tuple[str, int, int, int], PackProgram] = {}
        self._streams = Streams()
        self.images = Images()
        """Delta syncs: what each engine rank was last served, per pull (kvmove.sync.delta.detect)."""
        for device in {t.device for s in self.slots.values() for t in s if t.is_cuda}:
            warm_delta(device, "trainer")  # a first delta sync pays no compilation

    def slot_bytes(self, strategy: str) -> int:
        return sum(s.numel() for s in self.slots.get(strategy, ()))

    def register_pulls(self, strategy: str, engine: int, pulls: PullSpecs) -> None:
        """Cache what engine rank ``engine`` will ask for under ``strategy``: pull id -> (group, slice specs); and,
        for pulls served from raw shards alone, the program packing each into each slot, each run once on its
        slot's stream (warm start: Triton compiles for these shapes, each slot's stream and allocator pool and the
        finiteness check's kernels come to exist now, so the first sync runs nothing for the first time)."""
        with self._cond:
            for pull_id, spec in pulls.items():
                self._pulls[(strategy, engine, pull_id)] = spec
        for pull_id, (_, specs) in pulls.items():
            if not specs or not all(s.shard and s.tensor in self._shards for s in specs):
                continue
            held = [self._shards[s.tensor] for s in specs]
            for slot, buf in enumerate(self.slots.get(strategy, ())):
                packing = pack_program(buf, specs, held)
                if packing.program.persistent and not packing.program.scratch_bytes:
                    self._programs[(strategy, engine, pull_id, slot)] = packing
                    with self._streams.on(buf, slot):
                        packing.program.warm()
        for buf in self.slots.get(strategy, ())[:1]:
            if buf.is_cuda:  # the warm-up's work is done before init returns, not queued into the first sync
                torch.cuda.synchronize(buf.device)

    def forget_engine(self, engine: int) -> None:
        with self._cond:
            for key in [k for k in self._pulls if k[1] == engine]:
                del self._pulls[key]
            for program in [k for k in self._programs if k[1] == engine]:
                del self._programs[program]
            self.images.forget(engine)

    # -- the sync loop -------------------------------------------------------------------------------------
    def run_sync(self, sync: TrainerSync, published: Callable[[int], None] | None = None) -> TrainerStats:
        """Materialize and publish group after group; ``published(n)`` runs at the start (n=0) and after the n-th
        group (a fault hook)."""
        start = time.perf_counter()
        calls0 = self.source.collective_calls
        with self._cond:
            self._state = _State(sync, pending={g: set(c) for g, c in sync.consumers.items()})
            # NOTE: between syncs no read is in flight, so every slot is free again (a dead reader leaks none)
            self._free_slots = {strategy: list(range(len(s))) for strategy, s in self.slots.items()}
            self._slot_owner.clear()
            self._slot_pull.clear()
            self._extra = self.slot_bytes(sync.strategy.name)
            self._peak_extra = self._extra + self.images.nbytes
            self.images.take_counts()
            self._served = self._pulls_served = 0
            self._pack_seconds = 0.0
        gather = wait = 0.0
        if published is not None:
            published(0)
        for n, (group, names) in enumerate(sync.groups, start=1):
            t0 = time.perf_counter()
            self._wait(lambda: self._resident() <= sync.lookahead, f"release of groups before {group}")
            t1 = time.perf_counter()
            gathered = [g for g in self.source.materialize(names, sync.strategy.scope) if g.tensor is not None]
            gather += time.perf_counter() - t1
            wait += t1 - t0
            self._publish(group, gathered)
            if published is not None:
                published(n)
        t0 = time.perf_counter()
        self._wait(lambda: self._resident() == 0, "release of the last groups")
        wait += time.perf_counter() - t0
        with self._cond:
            stats = TrainerStats(
                self.rank,
                time.perf_counter() - start,
                gather,
                self._pack_seconds,
                wait,
                self._served,
                self._pulls_served,
                self._peak_extra,
                self.source.collective_calls - calls0,
                delta=self.images.take_counts() if sync.delta is not None else {},
            )
            self._state = None
            self._cond.notify_all()
        return stats

    def _resident(self) -> int:
        assert self._state is not None
        return len(self._state.held)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.deadline_s
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"trainer rank {self.rank}: no {what} within {self.deadline_s:.0f} s")
                self._cond.wait(min(left, 0.5))

    def _fail(self, message: str) -> None:
        if self._state is not None:
            self._state.failed = message
            self._state = None
        self._cond.notify_all()
        raise SyncTimeout(message)

    def _publish(self, group: int, gathered: list[Gathered]) -> None:
        with self._cond:
            state = self._state
            assert state is not None
            state.held[group] = {g.name: g.tensor for g in gathered if g.tensor is not None}
            state.extra[group] = sum(_nbytes(g.tensor) for g in gathered if g.copied and g.tensor is not None)
            self._extra += state.extra[group]
            self._peak_extra = max(self._peak_extra, self._extra + self.images.nbytes)
            self._maybe_release(group)
            self._cond.notify_all()

    def _maybe_release(self, group: int) -> None:
        state = self._state
        assert state is not None
        if group in state.held and not (state.pending.get(group, set()) - state.gone):
            del state.held[group]
            self._extra -= state.extra.pop(group, 0)
            state.released.add(group)

    # -- called by engine ranks (other threads) -------------------------------------------------------------
    def pack(
        self, sync_id: int, strategy: str, engine: int, pull_id: int, timeout_s: float = 60.0, dense: bool = False
    ) -> Packed:
        """Pack pull ``pull_id`` of ``engine`` into a free slot once its group is materialized (``dense``: the whole
        payload even in a delta sync)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            key = (strategy, engine, pull_id)
            if key not in self._pulls:
                raise KvmoveError(f"trainer rank {self.rank}: engine rank {engine} never registered pull {key}")
            group, specs = self._pulls[key]
            while True:
                state = self._state
                if state is not None and state.sync.sync_id == sync_id:
                    if engine in state.gone:
                        raise KvmoveError(f"engine rank {engine} was dropped from sync {sync_id}")
                    if group in state.released:
                        raise KvmoveError(f"group {group} of sync {sync_id} was already released")
                    if group in state.held and self._free_slots[strategy]:
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SyncTimeout(f"trainer rank {self.rank}: group {group} of sync {sync_id} not served in time")
                self._cond.wait(min(left, 0.5))
            slot = self._free_slots[strategy].pop()
            self._slot_owner[(strategy, slot)] = engine
            self._slot_pull[(strategy, slot)] = (strategy, engine, pull_id)
            held = [self._held(state, group, s) for s in specs]
        t0 = time.perf_counter()
        buf = self.slots[strategy][slot]
        try:
            packing = self._programs.get((strategy, engine, pull_id, slot)) or pack_program(buf, specs, held)
            with self._streams.on(buf, slot) as stream:  # one stream per slot: packs of two slots overlap
                coded = self._serve(state, (strategy, engine, pull_id), packing, buf, specs, dense)
                if stream is not None and (coded is not None or not packing.program.quantize):
                    stream.synchronize()  # a reader elsewhere sees finished bytes
        except Exception:
            self.release_slot(strategy, slot)
            raise
        with self._cond:
            self._pack_seconds += time.perf_counter() - t0
            self._served += sum(n for s in specs for n in s.sizes) if coded is None else coded.nbytes
            self._pulls_served += 1
            if coded is not None:  # images live as long as the rank: they count toward its extra memory
                self._peak_extra = max(self._peak_extra, self._extra + self.images.nbytes)
        if coded is None:
            return Packed(slot, packing.nbytes)
        return Packed(slot, coded.nbytes, str(coded.encoding), coded.changed)

    def _serve(
        self,
        state: _State,
        key: tuple[str, int, int],
        packing: PackProgram,
        buf: torch.Tensor,
        specs: Sequence[ServeSpec],
        dense: bool = False,
    ) -> Coded | None:
        """Pack pull ``key`` into ``buf``: densely (its program's one synchronization, if it quantized), or in a
        delta sync as ``kvmove.sync.delta.detect`` chooses (None: the sync is dense). A pull the engine asked for
        ``dense`` is served against no base: whole, its image refreshed."""
        sync = state.sync
        if sync.delta is None:
            packing.program.run()
            return None
        base = None if dense else sync.delta.get(key[1])
        return self.images.serve(key, packing.program, buf, specs, sync.sync_id, base)

    def _held(self, state: _State, group: int, spec: ServeSpec) -> Held:
        """What ``spec`` is served from: this rank's raw shard, or the tensor it materialized for ``group``."""
        if not spec.shard:
            return Held(state.held[group][spec.tensor], Box.full(spec.shape))
        if spec.tensor not in self._shards:
            raise KvmoveError(f"trainer rank {self.rank} holds no raw shard of {spec.tensor} in an arena to serve")
        return self._shards[spec.tensor]

    def note_read(self, strategy: str, slot: int, seconds: float) -> None:
        """An engine rank read ``slot`` in ``seconds`` (negative: not measured): the cost of what it held."""
        with self._cond:
            key = self._slot_pull.pop((strategy, slot), None)
        if key is not None and seconds >= 0:
            self.images.note_read(key, seconds)

    def release_slot(self, strategy: str, slot: int) -> None:
        with self._cond:
            self._slot_owner.pop((strategy, slot), None)
            if slot not in self._free_slots[strategy]:
                self._free_slots[strategy].append(slot)
            self._cond.notify_all()

    def done(self, sync_id: int, group: int, engine: int) -> None:
        """Engine rank ``engine`` has everything it pulls of ``group`` from this rank."""
        with self._cond:
            state = self._state
            if state is None or state.sync.sync_id != sync_id:
                return
            state.pending.get(group, set()).discard(engine)
            self._maybe_release(group)
            self._cond.notify_all()

    def engine_gone(self, sync_id: int, engine: int) -> None:
        """Stop waiting for ``engine`` (dead or dropped) in this sync."""
        with self._cond:
            state = self._state
            if state is None or state.sync.sync_id != sync_id:
                return
            state.gone.add(engine)
            for (strategy, slot), owner in list(self._slot_owner.items()):
                if owner == engine:  # its reader is gone: the slot is free again
                    del self._slot_owner[(strategy, slot)]
                    self._free_slots[strategy].append(slot)
            for group in list(state.held):
                self._maybe_release(group)
            self._cond.notify_all()


def _raw_shards(source: WeightSource) -> dict[str, Held]:
    """The raw shards of ``source``'s arena (what entries served without a gather read), by HF name."""
    arena = source.arena()
    if arena is None:
        return {}
    views = shard_views(arena[0], arena[1], {t.name: t.dtype for t in source.metadata()})
    return {name: Held(view, arena[1].boxes[name]) for name, view in views.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
