"""Weight sources: what a trainer rank offers a sync. An RL framework plugs its trainer in here.

A trainer rank uses its :class:`WeightSource` through this interface only. kvmove's own :class:`ShardedSource`
holds one Megatron rank's shards of a seeded model in one arena and materializes full HF tensors with
all-gathers inside each gather group (the collectives a Megatron export runs); FSDP2/DTensor or Megatron
sources implement the same few methods. The driver builds one per trainer rank with ``SyncConfig.source``, a
picklable ``SourceContext -> WeightSource`` callable (default :func:`seeded_source`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.models.weights import seeded_tensor
from kvmove.sync.planning.direct import ArenaLayout, arena_layout, shard_views
from kvmove.sync.planning.formats import get_format
from kvmove.sync.planning.plan import Box
from kvmove.sync.ranks.collectives import Collectives
from kvmove.sync.ranks.control import Address
from kvmove.sync.strategies import Gather


class SourceContext(NamedTuple):
    """What a trainer rank's process knows when it builds its source."""

    model: ModelConfig
    layout: TrainerLayout
    rank: int
    device: str
    seed: int
    store: Address
    """A TCP rendezvous every trainer rank reaches (trainer rank 0 may host a store there) for the source's
    own process groups."""
    timeout_s: float
    tensor_format: str = "hf"
    """How the source must name and shape its tensors (``SyncConfig.tensor_format``)."""


class Gathered(NamedTuple):
    """One materialized tensor: the full HF tensor (None if this rank does not hold it after the gather) and
    whether it is a new copy (it counts toward the sync's peak extra memory) or memory the source keeps anyway."""

    name: str
    tensor: torch.Tensor | None
    copied: bool


class WeightSource(ABC):
    """A trainer rank's weights as a sync sees them.

    Contract:
    - ``metadata()`` describes the whole model (every HF tensor, in checkpoint order) identically on every rank,
      without moving data.
    - ``shards()`` names the raw shards this rank holds (HF name -> box of the HF tensor); the driver checks
      them against the trainer layout at init (step 1).
    - ``materialize(names, scope)`` is collective: every rank of the trainer calls it with the same names in the
      same order (per scope: the ranks of one pipeline stage for ``Gather.STAGE``, all ranks otherwise) and
      gets, per name, the full HF tensor if it holds it once that scope's gather ran, else None.
      ``held_names(scope)`` lists those names (None: every name).
    - ``step(version)`` runs before each sync: the weights of training step ``version`` must be in place (and
      visible to other processes: synchronized) when it returns.
    - ``train(batch)`` (optional) runs one training step of the rank's trainer on ``batch`` (an RL loop hands
      each rank the rollouts through ``TrainStep``) and returns what it reports; sources that only serve
      weights refuse it.
    - ``arena()`` (optional) is this rank's raw shards in one persistent uint8 buffer laid out by
      ``kvmove.sync.planning.direct.arena_layout`` and updated in place each step; engines then read regions
      straight out of it (direct pulls). None: every region is packed.
    - ``warm(scopes)`` (optional, collective like ``materialize``) runs once at init: it creates whatever the first
      ``materialize`` of those scopes would create (process groups, communicators, their buffers), so the first
      sync costs what the next ones do.
    """

    @abstractmethod
    def metadata(self) -> Sequence[TensorMeta]: ...

    @abstractmethod
    def shards(self) -> Mapping[str, Box]: ...

    @abstractmethod
    def held_names(self, scope: Gather) -> set[str] | None: ...

    @abstractmethod
    def materialize(self, names: Sequence[str], scope: Gather) -> Iterator[Gathered]: ...

    def step(self, version: int) -> None:  # noqa: B027 - a framework's weights are usually in place already
        """Bring the weights of training step ``version`` into place (default: nothing to do)."""

    def train(self, batch: Any) -> Any:
        """One training step on ``batch`` (default: this source trains nothing here)."""
        raise KvmoveError(f"{type(self).__name__} does not train: it takes no batch")

    def arena(self) -> tuple[torch.Tensor, ArenaLayout] | None:
        return None

    def warm(self, scopes: Collection[Gather]) -> None:  # noqa: B027 - a source without lazy set-up has nothing to do
        """Create at init what materializing in ``scopes`` needs (default: nothing)."""

    @property
    def collective_calls(self) -> int:
        """Collectives run so far (reported per sync; 0 if the source does not count them)."""
        return 0


def seeded_source(ctx: SourceContext) -> WeightSource:
    """kvmove's stand-in trainer: Megatron shards of seeded random weights, gathered over gloo/NCCL groups."""
    collectives = Collectives(ctx.rank, ctx.layout.world, ctx.store.host, ctx.store.port, ctx.timeout_s, ctx.device)
    return ShardedSource(ctx.model, ctx.layout, ctx.rank, collectives, ctx.seed, ctx.device, ctx.tensor_format)


class ShardedSource(WeightSource):
    """One trainer rank's Megatron shards of a seeded model, in one arena; ``step`` stands in for an optimizer step.

    ``tensor_format`` "hf" holds slices of HF tensors cut the way Megatron would; "megatron" holds megatron-core's
    own tensors (fused, interleaved, vocabulary-padded: ``kvmove.models.megatron``), built from the same seeded
    HF checkpoint the way Megatron-Bridge imports one, so engines verify against that checkpoint either way.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layout: TrainerLayout,
        rank: int,
        collectives: Collectives,
        seed: int = 0,
        device: str = "cpu",
        tensor_format: str = "hf",
        weights: Callable[[TensorMeta, int], torch.Tensor] | None = None,
    ):
        self.cfg, self.layout, self.rank, self.seed, self.device = cfg, layout, rank, seed, device
        self.weights = weights or (lambda t, version: seeded_tensor(t, seed, version, device))
        """HF tensor, version -> its weights (default: seeded; ``kvmove.sync.delta.stepping``: an optimizer's)."""
        self.coll = collectives
        self.format = get_format(tensor_format)
        self.ownership = self.format.ownership(cfg, layout)
        self.version = -1
        self._metas = {t.name: t for t in self.format.tensors(cfg, layout)}
        self._layout = arena_layout(self.ownership, self._metas.values(), rank)
        self._arena = torch.empty(self._layout.nbytes, dtype=torch.uint8, device=device)
        self._shards = shard_views(self._arena, self._layout, {n: t.dtype for n, t in self._metas.items()})

    def step(self, version: int) -> None:
        """Weights of training step ``version`` (same seed and version: same bits everywhere), written in place into
        the arena (as an optimizer step updates parameters in place)."""
        for name, full in self._full_tensors(version):
            self._shards[name].copy_(full[self._layout.boxes[name].slices()])
        if self._arena.is_cuda:  # peers read the arena from other processes: the bytes must be in place
            torch.cuda.current_stream(self._arena.device).synchronize()
        self.version = version

    def _full_tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors this rank holds a shard of, at ``version`` (built from the seeded HF checkpoint)."""
        hf_metas = {t.name: t for t in hf_tensors(self.cfg)}

        def hf(name: str) -> torch.Tensor:
            return self.weights(hf_metas[name], version)

        for name in self._layout.boxes:
            yield name, self.format.from_hf(self.cfg, self.layout, hf, self._metas[name])

    def arena(self) -> tuple[torch.Tensor, ArenaLayout]:
        return self._arena, self._layout

    def warm(self, scopes: Collection[Gather]) -> None:
        """Every process group ``materialize`` uses in ``scopes`` (each rank's gather groups; all ranks for a global
        gather; rank 0 and each tensor's first holder for a gather onto rank 0), created with one collective each."""
        groups: set[tuple[int, ...]] = set()
        for meta in self._metas.values():
            holdings = self.ownership.slices(meta)
            if _split_dim(holdings[0].box, meta.shape) is not None:
                groups |= {self.ownership.gather_group(meta, h.rank) for h in holdings}
            if Gather.ROOT in scopes:
                groups.add(tuple(sorted({min(h.rank for h in holdings), 0})))
        if Gather.GLOBAL in scopes:
            groups.add(tuple(range(self.layout.world)))
        self.coll.warm(groups)

    def metadata(self) -> list[TensorMeta]:
        return list(self._metas.values())

    def shards(self) -> dict[str, Box]:
        return dict(self._layout.boxes)

    @property
    def collective_calls(self) -> int:
        return self.coll.collective_calls

    def held_names(self, scope: Gather) -> set[str] | None:
        if scope is Gather.STAGE:
            return set(self._layout.boxes)
        return None if scope is Gather.GLOBAL or self.rank == 0 else set()

    def materialize(self, names: Sequence[str], scope: Gather) -> Iterator[Gathered]:
        for name in names:
            tensor = self._materialize(self._metas[name], scope)
            yield Gathered(name, tensor, tensor is not None and tensor is not self._shards.get(name))

    def _materialize(self, meta: TensorMeta, scope: Gather) -> torch.Tensor | None:
        full = self._gather_in_group(meta) if meta.name in self._layout.boxes else None
        if scope is Gather.STAGE:
            return full
        root = min(h.rank for h in self.ownership.slices(meta))
        members = range(self.layout.world) if scope is Gather.GLOBAL else sorted({root, 0})
        if self.rank not in members:
            return None
        if full is None:
            full = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return self.coll.broadcast(members, full, root)

    def _gather_in_group(self, meta: TensorMeta) -> torch.Tensor:
        shard = self._shards[meta.name]
        dims = _split_dims(self._layout.boxes[meta.name], meta.shape)
        if not dims:
            return shard
        group = self.ownership.gather_group(meta, self.rank)
        if len(dims) == 1:
            return self.coll.all_gather(group, shard, dims[0])
        # NOTE: cut on two dims (fused experts over EP and ETP): gather flat, then place each rank's box
        flat = self.coll.all_gather(group, shard.reshape(1, -1), 0)
        boxes = {h.rank: h.box for h in self.ownership.slices(meta)}
        return assemble(meta, [boxes[r] for r in sorted(group)], flat)


def assemble(meta: TensorMeta, boxes: Sequence[Box], rows: torch.Tensor) -> torch.Tensor:
    """Tensor ``meta`` from shards whose ``boxes`` tile it, each flattened into one row of ``rows`` (in order)."""
    full = torch.empty(meta.shape, dtype=meta.dtype, device=rows.device)
    for row, box in zip(rows, boxes, strict=True):
        full[box.slices()] = row.view(box.shape)
    return full


def _split_dims(box: Box, shape: tuple[int, ...]) -> list[int]:
    return [d for d, (a, b) in enumerate(zip(box.start, box.stop, strict=True)) if b - a != shape[d]]


def _split_dim(box: Box, shape: tuple[int, ...]) -> int | None:
    return next(iter(_split_dims(box, shape)), None)
