"""Building a strategy's :class:`~kvmove.bench.sim.traffic.Traffic` on a setup, item by item: who keeps, who
serves, what is gathered and how, per group (pure; milliseconds for a hundred groups)."""

from __future__ import annotations

import math

import numpy as np

from kvmove.bench.sim.grouprows import Contribution, GroupRows
from kvmove.bench.sim.groups import Demand, Item, by_owner, host_owner, units
from kvmove.bench.sim.mapped import Mapper, entry, strided_reads
from kvmove.bench.sim.pulls import count_pulls
from kvmove.bench.sim.setup import SimSetup
from kvmove.bench.sim.shards import (
    Piece,
    Split,
    direct_parts,
    engine_split,
    nested,
    quantizable,
    slice_index,
    trainer_shard_of,
    trainer_split,
    wire_bytes,
)
from kvmove.bench.sim.strategies import SimStrategy
from kvmove.bench.sim.traffic import Traffic
from kvmove.sync.delta.detect import region_class
from kvmove.sync.planning.entries import PLAIN, Entry


def build_traffic(setup: SimSetup, strategy: SimStrategy) -> Traffic:
    """The traffic of ``strategy`` on ``setup`` (pure; milliseconds for a hundred groups)."""
    groups = units(setup, strategy)
    b = _Builder(setup, strategy, len(groups))
    for g, unit in enumerate(groups):
        for item in unit.items:
            b.add(g, item)
        b.reload(g, unit.reload, unit.layers)
    return b.finish(np.array([u.times for u in groups]))


class _Builder(GroupRows):
    """Accumulates one strategy's per-group arrays, item by item (one occurrence of each group)."""

    def __init__(self, s: SimSetup, strategy: SimStrategy, groups: int, scratch: bool = False) -> None:
        super().__init__(groups, s.trainer.world, s.engine.ranks_per_replica)
        self.s, self.strategy = s, strategy
        ec = [s.engine.coord(r) for r in range(s.engine.ranks_per_replica)]
        self.e_pp, self.e_tp, self.e_ep = (np.array([getattr(c, k) for c in ec]) for k in ("pp", "tp", "ep"))
        tc = [s.trainer.layout.coord(r) for r in range(s.trainer.world)]
        self.t_pp, self.t_tp, self.t_ep, self.t_etp = (
            np.array([getattr(c, k) for c in tc]) for k in ("pp", "tp", "ep", "etp")
        )
        self._cache: dict[tuple[object, ...], Contribution] = {}
        self.mapper = Mapper(s)
        self._reloads: dict[tuple[object, ...], np.ndarray] = {}
        self._scratch: _Builder | None = _Builder(s, strategy, 1, scratch=True) if groups and not scratch else None

    def add(self, g: int, item: Item) -> None:
        """Add ``item`` to group ``g``; items differing only by layer index (same stages) cost the same, so each
        kind is computed once and its rows reused."""
        scratch = self._scratch
        if scratch is None:
            self._add(g, item)
            return
        key = self._key(item)
        if key not in self._cache:
            scratch.clear()
            scratch._add(0, item)
            self._cache[key] = scratch.snapshot()
        self.apply(g, self._cache[key])

    def _key(self, item: Item) -> tuple[object, ...]:
        s = self.s
        es = engine_split(s.model, s.engine, item.name, item.layer, item.expert0)
        ts = trainer_split(s.model, s.trainer.layout, item.name, item.layer, item.expert0) if self._megatron else None
        groups = s.trainer.world // s.trainer.shard
        where = item.layer % groups if s.trainer.kind == "fsdp" and item.layer is not None else None
        owner = host_owner(item, s.trainer.world) if s.trainer.kind == "host" else None
        generic = item.name if item.layer is None else item.name.replace(f".{item.layer}.", ".L.", 1)
        return (generic, item.shape, item.expert0, item.experts, es.stage, ts.stage if ts else 0, where, owner)

    def _add(self, g: int, item: Item) -> None:
        s = self.s
        w = float(wire_bytes(item.name, item.shape, s.wire_dtype, s.block))
        quantized = s.dtype == "fp8" and s.quantize_on in ("trainer", "engine") and quantizable(item.name, item.shape)
        bf = 2.0 * math.prod(item.shape) if quantized else 0.0
        es = engine_split(s.model, s.engine, item.name, item.layer, item.expert0)
        ts = trainer_split(s.model, s.trainer.layout, item.name, item.layer, item.expert0) if self._megatron else None
        self.stage[g] = ts.stage if ts else self._mesh_group(item)
        self.max_request[g] = max(self.max_request[g], es.keep * w)
        demands = self._demands(item, es)
        for keepers, tensors, _, _ in demands:
            self._keep(g, keepers, tensors, es.keep * w, es.keep * bf, region_class(item.name))
        if self.strategy.broadcast:
            self._broadcast(g, item, es, ts, w, bf)
            return
        planned = entry(item.name, item.shape, bf > 0 and s.quantize_on == "trainer", self._reads_shard(es, ts))
        plain = planned.transform == PLAIN
        parts = self._direct_parts(item, es, ts, demands, w) if plain else None
        if parts is not None:  # a direct read, whole or in pieces
            assert ts is not None
            for demand in demands:
                self._serve_direct(g, demand, es, ts, w, parts)
        else:  # packed: from the raw shard holding a plain slice (no gather), else once gathered
            in_shard = plain and planned.shard
            packed = [d for d in (self._serve_mapped(g, planned, d, es, ts, w, bf) for d in demands) if len(d[0])]
            for demand in packed:
                self._serve_packed(g, item, demand, es, ts, w, bf, in_shard)
            if packed or not demands:
                self._materialize(g, item, ts, packed, gather=not in_shard)

    @property
    def _strided(self) -> bool:
        """The transport reads 2-D copies (the registry's own flag; the generic ``pull`` is NIXL's 1-D reads)."""
        return strided_reads(self.s.transport)

    @property
    def _megatron(self) -> bool:
        return self.s.trainer.kind == "megatron"

    def _shard_reads(self, ts: Split | None) -> bool:
        """Whether the strategy serves items from the trainer's raw shards where it can (direct pulls)."""
        s = self.s  # a delta sync plans direct reads packed (kvmove.sync.driver.checks.delta_checked)
        return s.direct and s.delta is None and self.strategy.scope == "stage" and ts is not None

    def _reads_shard(self, es: Split, ts: Split | None) -> bool:
        """Whether the strategy serves the item from the raw shard holding each engine slice: read directly, or
        mapped, or packed from that shard."""
        return self._shard_reads(ts) and ts is not None and nested(es, ts)

    def _direct_parts(
        self, item: Item, es: Split, ts: Split | None, demands: list[Demand], w: float
    ) -> dict[int, list[Piece]] | None:
        """Each engine slice's pieces when the planner reads the item directly, None when it packs it."""
        if not self._shard_reads(ts) or not demands:
            return None
        assert ts is not None
        slices = {int(i) for d in demands for i in d[2]}
        return direct_parts(item.shape, round(w / math.prod(item.shape)), es, ts, slices, self._strided)

    # --- the engine side --------------------------------------------------------------------------------------
    def _demands(self, item: Item, es: Split) -> list[Demand]:
        stage = self.e_pp == es.stage
        if not item.experts:
            keepers = np.flatnonzero(stage)
            return [(keepers, np.ones(len(keepers)), self._index(es, keepers), None)]
        cfg, first = self.s.model, item.expert0 or 0
        experts = np.arange(first, first + item.experts)
        ep_owned = self._megatron and not self.s.ep_gather
        owner_t = experts // (cfg.num_experts // self.s.trainer.layout.ep) if ep_owned else None
        out: list[Demand] = []
        if self.s.engine.ep > 1:
            owner_e = experts // (cfg.num_experts // self.s.engine.ep)
            for j in np.unique(owner_e):
                keeper = np.flatnonzero(stage & (self.e_ep == j))
                mine = owner_e == j
                out += by_owner(
                    keeper, int(mine.sum()), None if owner_t is None else owner_t[mine], self._index(es, keeper)
                )
            return out
        keepers = np.flatnonzero(stage)
        return by_owner(keepers, item.experts, owner_t, self._index(es, keepers))

    def _index(self, es: Split, keepers: np.ndarray) -> np.ndarray:
        return np.array([slice_index(es, self.s.engine, int(t)) for t in self.e_tp[keepers]], dtype=np.int64)

    def _keep(self, g: int, keepers: np.ndarray, tensors: np.ndarray, kept: float, kept_bf: float, cls: str) -> None:
        e = self.e
        e["regions"][g, keepers] += tensors
        e["kept"][g, keepers] += tensors * kept
        if not self.strategy.broadcast:
            e["recv"][g, keepers] += tensors * kept
            e[f"recv.{cls}"][g, keepers] += tensors * kept
        if self.s.quantize_on == "engine":
            e["quant"][g, keepers] += tensors * kept_bf

    def reload(self, g: int, items: list[Item], layers: int) -> None:
        """Layer-wise reload: the layers completed in group ``g`` and each engine rank's bytes of them."""
        self.layers[g] = layers
        for item in items:
            key = ("reload", *self._key(item))
            if key not in self._reloads:
                row = np.zeros(self.s.engine.ranks_per_replica)
                w = float(wire_bytes(item.name, item.shape, self.s.wire_dtype, self.s.block))
                es = engine_split(self.s.model, self.s.engine, item.name, item.layer, item.expert0)
                for keepers, tensors, _, _ in self._demands(item, es):
                    row[keepers] += tensors * es.keep * w
                self._reloads[key] = row
            self.e["layer_bytes"][g] += self._reloads[key]

    # --- the trainer side -------------------------------------------------------------------------------------
    def _serve_direct(
        self, g: int, demand: Demand, es: Split, ts: Split, w: float, parts: dict[int, list[Piece]]
    ) -> None:
        keepers, tensors, index, owner = demand
        for k, n, idx in zip(keepers, tensors, index, strict=True):
            for piece in parts[int(idx)]:
                holders = self._holders(ts, owner, piece.shard, None)
                self.t["send"][g, holders] += n * es.keep * w * piece.fraction / len(holders)
                self.sources[g][(int(k), ("shard", tuple(holders)))] += int(n)
            self.e["direct"][g, k] += n

    def _serve_mapped(
        self, g: int, planned: Entry, demand: Demand, es: Split, ts: Split | None, w: float, bf: float
    ) -> Demand:
        """Keepers that quantize the item themselves from a trainer rank's mapped arena (``kvmove.bench.sim.mapped``)
        take its BF16 bytes as mapped and receive nothing; the rest of the demand is returned, to be packed."""
        keepers, tensors, index, owner = demand
        if ts is None:
            return demand
        mask = self.mapper.mapped(
            planned, keepers, lambda i: self._holders(ts, owner, trainer_shard_of(es, ts, int(index[i])), None)
        )
        if not mask.any():
            return demand
        mine, moved = keepers[mask], tensors[mask] * es.keep * w
        self.e["mapped"][g, mine] += tensors[mask] * es.keep * bf
        self.e["mapped_kept"][g, mine] += moved
        for key in ("recv", f"recv.{region_class(planned.tensor)}"):
            self.e[key][g, mine] -= moved
        return keepers[~mask], tensors[~mask], index[~mask], owner

    def _serve_packed(
        self, g: int, item: Item, demand: Demand, es: Split, ts: Split | None, w: float, bf: float, in_shard: bool
    ) -> None:
        """Pack the demand's slices on the ranks holding the gathered tensor, or (``in_shard``) on those whose raw
        shard holds each slice."""
        keepers, tensors, index, owner = demand
        if in_shard and ts is not None and len(keepers) > 1:
            for i in range(len(keepers)):
                one = (keepers[i : i + 1], tensors[i : i + 1], index[i : i + 1], owner)
                self._serve_packed(g, item, one, es, ts, w, bf, in_shard)
            return
        shard = trainer_shard_of(es, ts, int(index[0])) if in_shard and ts is not None else None
        holders = self._holders(ts, owner, shard, None if in_shard else item)
        total, share = float(tensors.sum()), 1.0 / len(holders)
        t = self.t
        t["send"][g, holders] += total * es.keep * w * share
        t["regions"][g, holders] += total * share
        if bf and self.s.quantize_on == "trainer":  # the quantize programs write FP8 and scales into the slot
            t["quant"][g, holders] += total * es.keep * bf * share
        else:
            t["pack"][g, holders] += total * es.keep * w * share
        if self.s.via_host:
            t["h2d"][g, holders] += total * es.keep * w * share
        self.e["scatter"][g, keepers] += tensors * es.keep * w
        key = ("from", owner, tuple(holders))
        for k, n in zip(keepers, tensors, strict=True):
            self.sources[g][(int(k), key)] += int(n)

    def _broadcast(self, g: int, item: Item, es: Split, ts: Split | None, w: float, bf: float) -> None:
        """Every engine rank of the stage receives the full tensors; a root rank sends each once."""
        receivers = np.flatnonzero(self.e_pp == es.stage)
        full = item.tensors * w
        self.e["recv"][g, receivers] += full
        self.e["scatter"][g, receivers] += full * es.keep if not item.experts else 0.0
        if item.experts:
            for keepers, tensors, _, _ in self._demands(item, es):
                self.e["scatter"][g, keepers] += tensors * es.keep * w
        roots = self._holders(ts, None, None, item)
        if self._funnel:
            roots = np.zeros(1, dtype=np.int64)  # kvmove's send_all: trainer rank 0 alone broadcasts
        elif not (self.s.trainer.kind == "host" and item.experts):
            roots = roots[:1]  # one root per tensor; a host trainer's expert tensors are spread over its ranks
        self.t["send"][g, roots] += full / len(roots)
        self.t["regions"][g, roots] += item.tensors / len(roots)
        if bf and self.s.quantize_on == "trainer":
            self.t["quant"][g, roots] += item.tensors * bf / len(roots)
        if self.s.trainer.kind == "host":
            self.t["h2d"][g, roots] += full / len(roots)
        if not self._funnel:
            self._materialize(g, item, ts, [])
            return
        assert ts is not None
        demands = self._demands(item, es)
        before = float(self.t["yield"][g, 0])
        self._materialize(g, item, ts, demands)
        self.t["yield"][g, 0] += item.tensors - (float(self.t["yield"][g, 0]) - before)  # rank 0 visits every one
        self._onto_rank0(g, item, ts, demands)

    @property
    def _funnel(self) -> bool:
        return self.strategy.broadcast and self.s.funnel

    def _onto_rank0(self, g: int, item: Item, ts: Split, demands: list[Demand]) -> None:
        """kvmove's broadcast: each tensor, once gathered in its group, goes from its first holder to trainer rank 0
        by a broadcast between the two (``kvmove.sync.ranks.source``: ``Gather.ROOT``), unless rank 0 holds it."""
        stage = self.t_pp == ts.stage
        bf = 2.0 * math.prod(item.shape)
        for owner in {d[3] for d in demands} or {None}:
            holders = np.flatnonzero(stage & (self.t_ep == owner)) if owner is not None else np.flatnonzero(stage)
            per = float(item.tensors) if owner is None else float(sum(d[1][0] for d in demands if d[3] == owner))
            root = int(holders.min())
            if root != 0:
                self._collective(g, -2, np.array([root, 0]), bf, per)

    def _mesh_group(self, item: Item) -> int:
        """FSDP: the mesh group that materializes the item's layer (groups work on disjoint layers at once)."""
        if self.s.trainer.kind != "fsdp" or item.layer is None:
            return 0
        return item.layer % (self.s.trainer.world // self.s.trainer.shard)

    def _holders(self, ts: Split | None, owner: int | None, shard: int | None, item: Item | None) -> np.ndarray:
        s, world = self.s, self.s.trainer.world
        if s.trainer.kind == "fsdp":
            q = 0 if item is None else self._mesh_group(item)
            return np.arange(q * s.trainer.shard, (q + 1) * s.trainer.shard)
        if s.trainer.kind == "host":
            return np.arange(world) if item is not None and item.experts else np.array([host_owner(item, world)])
        assert ts is not None
        if self.strategy.scope == "global":
            return np.arange(world)
        mask = self.t_pp == ts.stage
        if self.strategy.broadcast:
            return np.flatnonzero(mask)[:1]
        if owner is not None:
            mask &= self.t_ep == owner
        if shard is not None and ts.dim is not None:
            mask &= (self.t_etp if owner is not None else self.t_tp) == shard
        return np.flatnonzero(mask)

    def _materialize(self, g: int, item: Item, ts: Split | None, demands: list[Demand], gather: bool = True) -> None:
        """Ranks yield the item from the weight source and all-gather it where it is split (unless ``gather`` is
        off: slices packed from the raw shards holding them)."""
        s, n = self.s, float(item.tensors)
        if s.trainer.kind == "host":
            return
        bf = 2.0 * math.prod(item.shape)
        if s.trainer.kind == "fsdp":
            ranks = self._holders(None, None, None, item)
            self._collective(g, s.trainer.shard, ranks, bf, n)
            self.t["yield"][g, ranks] += n
            return
        assert ts is not None
        layout = s.trainer.layout
        if self.strategy.scope == "global":  # gathered in its group, then broadcast to every rank (ranks.source)
            if ts.dim is not None:
                self._collective(g, ts.parts, np.flatnonzero(self.t_pp == ts.stage), bf, n)
            self._collective(g, -layout.world, np.arange(layout.world), bf, n)
            self.t["yield"][g, :] += n
            return
        stage = self.t_pp == ts.stage
        ep_gather = (self.strategy.broadcast and not s.funnel) or s.ep_gather
        if ep_gather and item.experts:
            self._collective(g, layout.ep * layout.etp, np.flatnonzero(stage), bf, n)
        owners = {d[3] for d in demands} or {None}
        for owner in owners:
            ranks = np.flatnonzero(stage & (self.t_ep == owner)) if owner is not None else np.flatnonzero(stage)
            per = n if owner is None else float(sum(d[1][0] for d in demands if d[3] == owner))
            self.t["yield"][g, ranks] += per
            if gather and ts.dim is not None and not (ep_gather and item.experts):
                self._collective(g, ts.parts, ranks, bf, per)

    def _collective(self, g: int, n: int, ranks: np.ndarray, bf: float, tensors: float) -> None:
        """An all-gather over ``n`` ranks (a broadcast to ``-n`` ranks: each receives the whole tensor)."""
        if abs(n) <= 1 or not len(ranks):
            return
        ops, nbytes = self.collectives(n)
        ops[g, ranks] += tensors
        nbytes[g, ranks] += tensors * bf * ((n - 1) / n if n > 0 else 1.0)

    def finish(self, count: np.ndarray) -> Traffic:
        """Pulls per engine rank and trainer calls from each group's sources (``kvmove.bench.sim.pulls``)."""
        count_pulls(self.sources, self.e["pulls"], self.e["direct_pulls"], self.t["calls"])
        return Traffic(self.strategy, count, self.stage, self.layers, self.t, self.e, self.gather, self.max_request)
