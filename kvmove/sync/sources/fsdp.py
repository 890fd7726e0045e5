"""A live FSDP2 model as a weight source: parameters that are DTensors of ``torch.distributed.fsdp.fully_shard``.

Ownership comes from each parameter's placements: the box of the global tensor a rank's local shard covers
(``Shard(0)`` over the data-parallel ranks: a block of rows; an empty box where FSDP2's chunking leaves a rank
nothing). Checkpoint names are the module's parameter names; a fused expert parameter of transformers v5
(``mlp.experts.gate_up_proj``, ``down_proj``: one 3-D tensor per layer) is offered as the checkpoint's
per-expert tensors, each held whole by the rank whose rows of the fused tensor contain that expert.

Materialization is collective: ``DTensor.full_tensor()`` (an all-gather over the mesh) for a sharded tensor,
a broadcast from the holder for an expert tensor when another rank needs it. With ``arena=True`` the source
keeps its local shards in one registered buffer (``arena()``): every region lying in one rank's shard is then
read by engines straight from it. FSDP2 keeps each parameter's shard in its own storage, so ``step`` copies the
shards into the arena once per training step (one memcpy of this rank's 1/N of the model; the copy's seconds
are reported as ``last_copy_seconds``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.models.table import checkpoint_views, memory_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.sync.planning.direct import ARENA_ALIGN, ArenaLayout, arena_order
from kvmove.sync.planning.plan import Box
from kvmove.sync.ranks.source import Gathered, WeightSource
from kvmove.sync.strategies import Gather


class Piece(NamedTuple):
    """Where one checkpoint tensor lives in the model: parameter ``param``, or expert ``expert`` of a fused
    parameter, rows ``rows`` of that expert (gate and up share ``gate_up_proj``)."""

    param: str
    expert: int | None = None
    rows: slice | None = None


def checkpoint_pieces(model: nn.Module) -> dict[str, Piece]:
    """Checkpoint name -> piece of ``model``'s parameters (parameters shared by tying appear once) and persistent
    buffers, as transformers' own checkpoint conversion places each checkpoint tensor
    (kvmove.models.table.checkpoint_views)."""
    params = memory_tensors(model)
    out: dict[str, Piece] = {}
    for name, view in checkpoint_views(model).items():
        shape = tuple(params[view.param].shape)
        if view.offset == 0 and view.shape == shape:
            out[name] = Piece(view.param)
            continue
        per_expert = math.prod(shape[1:])
        row = math.prod(shape[2:])
        expert, within = divmod(view.offset, per_expert)
        start = within // row
        contiguous = view.stride == tuple(torch.empty(view.shape, device="meta").stride())
        if len(view.shape) != len(shape) - 1 or not contiguous or within % row or view.shape[1:] != shape[2:]:
            raise KvmoveError(f"{name}: not a block of rows of one expert of {view.param} {shape}")
        whole = start == 0 and view.shape[0] == shape[1]
        out[name] = Piece(view.param, expert, None if whole else slice(start, start + view.shape[0]))
    return out


def local_box(param: torch.Tensor) -> Box:
    """The box of ``param``'s global tensor that this rank's local shard covers (from its DTensor placements)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return Box.full(tuple(param.shape))
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return Box(tuple(offset), tuple(o + n for o, n in zip(offset, shape, strict=True)))


class Local(NamedTuple):
    """A tensor as this rank holds it after its gather (None: this rank keeps none) and whether it is a copy."""

    tensor: torch.Tensor | None
    copied: bool


class FsdpSource(WeightSource):
    """A live FSDP2/DTensor model's weights as a sync sees them (see module docstring).

    ``group`` is the process group of the model's mesh (its ranks in order: the trainer ranks); ``order`` names
    every checkpoint tensor in checkpoint order (``kvmove.models.table.hf_tensors``); ``on_step(version)``
    runs in ``step`` before the weights are taken (a training step, a checkpoint save); ``on_train(batch)``
    is ``train`` (a training step on data the driver hands this rank: an RL loop's rollouts). ``image_dtype``
    (e.g. BF16 over FP32 master parameters, as mixed precision trains): what the sync serves, each tensor rounded
    to it (None: the parameters' own dtype).
    """

    def __init__(
        self,
        model: nn.Module,
        group: Any,
        order: Sequence[str],
        *,
        arena: bool = True,
        on_step: Callable[[int], None] | None = None,
        on_train: Callable[[Any], Any] | None = None,
        image_dtype: torch.dtype | None = None,
    ) -> None:
        import torch.distributed as dist

        self.model, self.group, self.on_step, self.on_train = model, group, on_step, on_train
        self.image_dtype = image_dtype
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.params = memory_tensors(model)  # persistent buffers too: held whole on every rank
        pieces = checkpoint_pieces(model)
        missing = sorted(set(order) ^ set(pieces))
        if missing:
            raise KvmoveError(f"the model's parameters and the checkpoint disagree on {missing[0]}")
        self.pieces = {name: pieces[name] for name in order}
        self._metas = [
            TensorMeta(n, self._global_shape(p), image_dtype or self.params[p.param].dtype)
            for n, p in self.pieces.items()
        ]
        self._boxes = {m.name: self._box(m) for m in self._metas}
        self._shards = {n: b for n, b in self._boxes.items() if b is not None}
        self._owner = self._expert_owners()
        self._collectives = 0
        self.last_copy_seconds = 0.0
        self._arena = self._layout = None
        if arena:
            self._layout = _layout(self._metas, self._shards)
            self._arena = torch.zeros(self._layout.nbytes, dtype=torch.uint8, device=self._device())

    # -- metadata --------------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def _global_shape(self, piece: Piece) -> tuple[int, ...]:
        shape = tuple(self.params[piece.param].shape)
        if piece.expert is None:
            return shape
        rows = shape[1] if piece.rows is None else piece.rows.stop - piece.rows.start
        return (rows, *shape[2:])

    def _box(self, meta: TensorMeta) -> Box | None:
        """The box of checkpoint tensor ``meta`` this rank holds (an empty one: it joins the gather only)."""
        piece = self.pieces[meta.name]
        box = local_box(self.params[piece.param])
        if piece.expert is None:
            return box
        rest = zip(box.start[1:], box.stop[1:], self.params[piece.param].shape[1:], strict=True)
        if any(a != 0 or b != n for a, b, n in rest):
            raise KvmoveError(f"{piece.param}: fused experts must be sharded by whole experts (dim 0 only)")
        return Box.full(meta.shape) if box.start[0] <= piece.expert < box.stop[0] else None

    def _expert_owners(self) -> dict[str, int]:
        """Expert tensors -> the lowest rank holding each (the ranks exchange which experts they hold, once)."""
        import torch.distributed as dist

        mine = sorted(n for n, p in self.pieces.items() if p.expert is not None and n in self._shards)
        every: list[list[str] | None] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        out: dict[str, int] = {}
        for rank, names in enumerate(every):
            for name in names or ():
                out.setdefault(name, rank)
        return out

    def metadata(self) -> list[TensorMeta]:
        return list(self._metas)

    def shards(self) -> dict[str, Box]:
        return dict(self._shards)

    def arena(self) -> tuple[torch.Tensor, ArenaLayout] | None:
        if self._arena is None or self._layout is None:
            return None
        return self._arena, self._layout

    @property
    def collective_calls(self) -> int:
        return self._collectives

    # -- per step --------------------------------------------------------------------------------------------
    def step(self, version: int) -> None:
        """Run ``on_step`` (training), then copy this rank's shards into the arena."""
        if self.on_step is not None:
            self.on_step(version)
        if self._arena is None or self._layout is None:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, off in self._layout.offsets.items():
                local = self._local(name)
                dtype = self.image_dtype or local.dtype  # copy_ rounds FP32 masters to the image (nearest-even)
                self._arena[off : off + local.numel() * dtype.itemsize].view(dtype).view(local.shape).copy_(local)
        if self._arena.is_cuda:
            torch.cuda.current_stream(self._arena.device).synchronize()
        self.last_copy_seconds = time.perf_counter() - t0

    def train(self, batch: Any) -> Any:
        if self.on_train is None:
            return super().train(batch)
        return self.on_train(batch)

    def _local(self, name: str) -> torch.Tensor:
        """This rank's shard of checkpoint tensor ``name`` (a view of the parameter's local tensor)."""
        piece = self.pieces[name]
        param = self.params[piece.param]
        local = param.to_local() if hasattr(param, "to_local") else param
        if piece.expert is None:
            return local.detach()
        e = piece.expert - local_box(param).start[0]
        out = local.detach()[e]
        return out if piece.rows is None else out[piece.rows]

    # -- gathers ---------------------------------------------------------------------------------------------
    def held_names(self, scope: Gather) -> set[str] | None:
        if scope is Gather.STAGE:
            return set(self._shards)
        return None if scope is Gather.GLOBAL or self.rank == 0 else set()

    def materialize(self, names: Sequence[str], scope: Gather) -> Iterator[Gathered]:
        with torch.no_grad():
            for name in names:
                tensor, copied = self._materialize(name, scope)
                if tensor is not None and self.image_dtype is not None and tensor.dtype != self.image_dtype:
                    tensor, copied = tensor.to(self.image_dtype), True
                yield Gathered(name, tensor, copied)

    def _materialize(self, name: str, scope: Gather) -> Local:
        piece = self.pieces[name]
        keep = scope is not Gather.ROOT or self.rank == 0
        if piece.expert is None:
            param = self.params[piece.param]  # NOTE: the checkpoint may rename it (Mixtral's block_sparse_moe.gate)
            if not hasattr(param, "full_tensor"):
                return Local(param.detach(), False)
            self._collectives += 1
            full = param.full_tensor()
            return Local(full, True) if keep else Local(None, False)
        owner = self._owner[name]
        if scope is Gather.STAGE:
            if owner != self.rank:
                raise KvmoveError(f"trainer rank {self.rank} does not hold {name} (rank {owner} does)")
            return Local(self._local(name), False)
        return self._broadcast(name, owner, keep)

    def _broadcast(self, name: str, owner: int, keep: bool) -> Local:
        import torch.distributed as dist

        meta = next(m for m in self._metas if m.name == name)
        mine = self.rank == owner
        buf = self._local(name).to(meta.dtype).contiguous() if mine else torch.empty(meta.shape, dtype=meta.dtype)
        dist.broadcast(buf, dist.get_global_rank(self.group, owner), group=self.group)
        self._collectives += 1
        if not keep:
            return Local(None, False)
        return Local(buf, not mine or self.image_dtype is not None)


def _layout(metas: Sequence[TensorMeta], shards: Mapping[str, Box]) -> ArenaLayout:
    offsets, boxes, at = {}, {}, 0
    for t in arena_order(m for m in metas if m.name in shards):
        offsets[t.name], boxes[t.name] = at, shards[t.name]
        at += -(-shards[t.name].numel * t.dtype.itemsize // ARENA_ALIGN) * ARENA_ALIGN
    return ArenaLayout(offsets, boxes, max(at, ARENA_ALIGN))
