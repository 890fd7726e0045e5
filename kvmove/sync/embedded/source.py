"""A framework's weights as a kvmove ``WeightSource``: a re-iterable ``(name, tensor)`` source on every rank.

The shape vLLM's trainer side uses (``vllm.distributed.weight_transfer.WeightSource``, e.g. ``ModuleSource`` over
a plain or FSDP-sharded module): ``metadata()`` lists every parameter (name, dtype, full shape) without moving
data, and each ``iter(source)`` is a fresh pass yielding full tensors in that order, materializing each with a
collective (FSDP's ``full_tensor()``) that every rank runs in lockstep. :class:`IterableSource` serves kvmove's
trainer loop from one such pass per sync: every rank materializes every tensor (the trainer layout is data
parallel: each rank holds each full tensor once gathered), so pulls spread over all trainer ranks. Tensors the
loop asks for out of the source's order are taken from the pass and kept until asked for (within a decoder
layer, the orders of HF modules and checkpoints differ); each is cast to the checkpoint's dtype (bf16) as vLLM's
own loader would cast it on copy.

A source may name its tensors as the checkpoint does, or as a transformers model of the engines' config holds
them in memory (``ModuleSource`` over a transformers 5 Mixtral offers ``mlp.experts.gate_up_proj``, one tensor of
every expert, where the checkpoint holds ``block_sparse_moe.experts.E.w1.weight``...): each checkpoint tensor is
then a view of the source tensor that transformers' own checkpoint conversion cuts it from
(kvmove.models.table.memory_layout), and the source tensor is kept until its last view is served.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import TrainerLayout
from kvmove.models.table import View, hf_tensors, memory_layout
from kvmove.models.tensors import TensorMeta
from kvmove.sync.planning.plan import Box
from kvmove.sync.ranks.source import Gathered, WeightSource
from kvmove.sync.strategies import Gather


def data_parallel(world: int) -> TrainerLayout:
    """The trainer layout of ranks that each materialize every full tensor."""
    return TrainerLayout(dp=world)


class IterableSource(WeightSource):
    """kvmove's view of a re-iterable source (see the module docstring); ``reset`` starts the next pass."""

    def __init__(self, source: Any, cfg: ModelConfig, device: str = "cpu") -> None:
        self.source, self.device = source, device
        self._metas = {t.name: t for t in hf_tensors(cfg)}
        self._views = source_views(source, cfg, self._metas)
        self._pass: Iterator[tuple[str, torch.Tensor]] | None = None
        self._ahead: dict[str, torch.Tensor] = {}
        self._left: Counter[str] = Counter()

    def metadata(self) -> list[TensorMeta]:
        return list(self._metas.values())

    def shards(self) -> dict[str, Box]:
        return {name: Box.full(t.shape) for name, t in self._metas.items()}

    def held_names(self, scope: Gather) -> set[str] | None:
        return None

    def reset(self) -> None:
        """Drop the current pass (and what it read ahead): the next ``materialize`` starts a fresh one."""
        self._pass, self._ahead = None, {}
        self._left = Counter(v.param for v in self._views.values())

    def step(self, version: int) -> None:
        self.reset()

    def materialize(self, names: Sequence[str], scope: Gather) -> Iterator[Gathered]:
        if self._pass is None:
            self.reset()
            self._pass = iter(self.source)
        for name in names:
            view = self._views[name]
            while view.param not in self._ahead:
                try:
                    got, tensor = next(self._pass)
                except StopIteration:
                    raise KvmoveError(f"the trainer's WeightSource ended its pass without yielding {name}") from None
                self._ahead[got] = tensor
            self._left[view.param] -= 1
            held = self._ahead[view.param] if self._left[view.param] else self._ahead.pop(view.param)
            yield Gathered(name, self._wire(name, _cut(held, view)), True)

    def _wire(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        meta = self._metas[name]
        if tuple(tensor.shape) != meta.shape:
            raise KvmoveError(
                f"the trainer's WeightSource yielded {name} of shape {tuple(tensor.shape)}, not {meta.shape}"
            )
        return tensor.detach().to(device=self.device, dtype=meta.dtype).contiguous()


def source_views(source: Any, cfg: ModelConfig, want: Mapping[str, TensorMeta]) -> dict[str, View]:
    """Checkpoint name -> where it lies in the source's tensors: the tensor of that name, or (a source named as
    transformers holds ``cfg`` in memory) the view transformers' checkpoint conversion cuts it from."""
    have = metadata_of(source)
    if set(have) != set(want):
        memory = memory_layout(cfg)
        if len(set(have) & set(memory.shapes)) > len(set(have) & set(want)):  # named as held in memory
            check_metadata(have, {n: TensorMeta(n, shape) for n, shape in memory.shapes.items()})
            return memory.views
    check_metadata(have, want)
    return {n: View(n, 0, t.shape, tuple(torch.empty(t.shape, device="meta").stride())) for n, t in want.items()}


def _cut(tensor: torch.Tensor, view: View) -> torch.Tensor:
    """The checkpoint tensor ``view`` describes, cut from the source tensor holding it."""
    if view.offset == 0 and tuple(tensor.shape) == view.shape:
        return tensor
    whole = tensor.contiguous()
    return whole.as_strided(view.shape, view.stride, whole.storage_offset() + view.offset)


def metadata_of(source: Any) -> dict[str, tuple[int, ...]]:
    """The source's ``metadata()`` as name -> shape, and no partial ownership (``held_names()`` None)."""
    try:
        metas = list(source.metadata())
        have = {str(m.name): tuple(int(d) for d in m.shape) for m in metas}
    except AttributeError as exc:
        raise KvmoveError(
            f"a trainer source needs metadata() listing (name, dtype, shape) entries and iteration over (name, "
            f"tensor) pairs, as vLLM's WeightSource has ({exc})"
        ) from None
    held = getattr(source, "held_names", lambda: None)()
    if held is not None:
        raise KvmoveError(
            "the trainer's WeightSource holds only part of the model (held_names() is not None): pass a kvmove "
            "WeightSource with its trainer layout for partial ownership"
        )
    return have


def check_metadata(have: Mapping[str, tuple[int, ...]], want: Mapping[str, TensorMeta]) -> None:
    """The source's tensors (``have``: name -> shape) are exactly the tensors ``want`` lists, with their shapes."""
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    shapes = [n for n in want if n in have and have[n] != want[n].shape]
    if missing or extra or shapes:
        parts = [
            f"missing {_some(missing)}" if missing else "",
            f"not loaded by the engines: {_some(extra)}" if extra else "",
        ]
        parts += [f"{n} is {have[n]} here, {want[n].shape} in the engines" for n in shapes[:1]]
        raise KvmoveError(
            "the trainer's WeightSource does not match the engines' model: " + "; ".join(p for p in parts if p)
        )


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
