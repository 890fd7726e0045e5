"""Weight sources: what a trainer rank offers a sync (metadata, materialized tensors, held names).

An RL framework plugs its trainer in by implementing :class:`WeightSource`. kvmove's own
:class:`ShardedSource` holds one Megatron rank's shards of a seeded model and materializes full HF tensors
with gloo all-gathers inside each gather group (the same collectives a Megatron export runs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch

from kvmove.layout import TrainerLayout
from kvmove.models.config import ModelConfig
from kvmove.models.tensors import TensorMeta, hf_tensors
from kvmove.sync.collectives import Collectives
from kvmove.sync.direct import ArenaLayout, arena_layout, shard_views
from kvmove.sync.ownership import Ownership
from kvmove.sync.plan import Box
from kvmove.sync.verify import seeded_tensor


class WeightSource(ABC):
    """A trainer rank's view of the model for syncing.

    Contract:
    - ``metadata()`` describes the whole model identically on every rank, without moving data.
    - ``materialize(names, scope)`` is collective: every rank of the trainer calls it with the same names in
      the same order (per scope: the ranks of one pipeline stage for "stage", all ranks otherwise) and gets, for
      each name, the full HF tensor if it holds it after that scope's gather, else None.
    - ``held_names(scope)`` lists what ``materialize`` yields non-None here (None means everything).
    """

    @abstractmethod
    def metadata(self) -> list[TensorMeta]: ...

    @abstractmethod
    def held_names(self, scope: str) -> set[str] | None: ...

    @abstractmethod
    def materialize(self, names: Sequence[str], scope: str) -> Iterator[tuple[str, torch.Tensor | None]]: ...

    def arena(self) -> tuple[torch.Tensor, ArenaLayout] | None:
        """This rank's raw shards in one persistent uint8 buffer laid out by ``kvmove.sync.direct.arena_layout``
        (updated in place each step), so engines can read them directly; None if the source has no such buffer."""
        return None


class ShardedSource(WeightSource):
    """One trainer rank's Megatron shards of a seeded model; ``set_version`` stands in for an optimizer step."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: TrainerLayout,
        rank: int,
        collectives: Collectives,
        seed: int = 0,
        device: str = "cpu",
    ):
        self.cfg, self.layout, self.rank, self.seed, self.device = cfg, layout, rank, seed, device
        self.coll = collectives
        self.ownership = Ownership(cfg, layout)
        self.version = -1
        self._metas = {t.name: t for t in hf_tensors(cfg)}
        self._layout = arena_layout(self.ownership, self._metas.values(), rank)
        self._boxes = dict(self._layout.boxes)
        self._arena = torch.empty(self._layout.nbytes, dtype=torch.uint8, device=device)
        self.shards: dict[str, torch.Tensor] = shard_views(
            self._arena, self._layout, {n: t.dtype for n, t in self._metas.items()}
        )

    @property
    def shard_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shards.values())

    def set_version(self, version: int) -> None:
        """Weights of training step ``version`` (deterministic: same seed and version, same bits everywhere),
        written in place into the arena (as an optimizer step updates parameters in place)."""
        for name, box in self._boxes.items():
            full = seeded_tensor(self._metas[name], self.seed, version, self.device)
            self.shards[name].copy_(full[box.slices()])
        if self._arena.is_cuda:  # peers read the arena from other processes: the bytes must be in place
            torch.cuda.current_stream(self._arena.device).synchronize()
        self.version = version

    def arena(self) -> tuple[torch.Tensor, ArenaLayout]:
        return self._arena, self._layout

    def metadata(self) -> list[TensorMeta]:
        return list(self._metas.values())

    def held_names(self, scope: str) -> set[str] | None:
        if scope == "global":
            return None
        if scope == "root":
            return None if self.rank == 0 else set()
        return set(self._boxes)

    def materialize(self, names: Sequence[str], scope: str) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name in names:
            yield name, self._materialize(self._metas[name], scope)

    def _materialize(self, meta: TensorMeta, scope: str) -> torch.Tensor | None:
        full = self._gather_in_group(meta) if meta.name in self._boxes else None
        if scope == "stage":
            return full
        owners = sorted(h.rank for h in self.ownership.slices(meta))
        root = owners[0]
        members = range(self.layout.world) if scope == "global" else sorted({root, 0})
        if self.rank not in members:
            return None
        if full is None:
            full = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return self.coll.broadcast(members, full, root)

    def _gather_in_group(self, meta: TensorMeta) -> torch.Tensor:
        shard = self.shards[meta.name]
        rule_dim = _split_dim(self._boxes[meta.name], meta.shape)
        if rule_dim is None:
            return shard
        group = self.ownership.gather_group(meta, self.rank)
        return self.coll.all_gather(group, shard, rule_dim)


def _split_dim(box: Box, shape: tuple[int, ...]) -> int | None:
    return next((d for d, (a, b) in enumerate(zip(box.start, box.stop, strict=True)) if b - a != shape[d]), None)
