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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import TrainerLayout
from kvmove.models.table import hf_tensors
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
        check_metadata(source, self._metas)
        self._pass: Iterator[tuple[str, torch.Tensor]] | None = None
        self._ahead: dict[str, torch.Tensor] = {}

    def metadata(self) -> list[TensorMeta]:
        return list(self._metas.values())

    def shards(self) -> dict[str, Box]:
        return {name: Box.full(t.shape) for name, t in self._metas.items()}

    def held_names(self, scope: Gather) -> set[str] | None:
        return None

    def reset(self) -> None:
        """Drop the current pass (and what it read ahead): the next ``materialize`` starts a fresh one."""
        self._pass, self._ahead = None, {}

    def step(self, version: int) -> None:
        self.reset()

    def materialize(self, names: Sequence[str], scope: Gather) -> Iterator[Gathered]:
        if self._pass is None:
            self._pass = iter(self.source)
        for name in names:
            while name not in self._ahead:
                try:
                    got, tensor = next(self._pass)
                except StopIteration:
                    raise KvmoveError(f"the trainer's WeightSource ended its pass without yielding {name}") from None
                self._ahead[got] = tensor
            yield Gathered(name, self._wire(name, self._ahead.pop(name)), True)

    def _wire(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        meta = self._metas[name]
        if tuple(tensor.shape) != meta.shape:
            raise KvmoveError(
                f"the trainer's WeightSource yielded {name} of shape {tuple(tensor.shape)}, not {meta.shape}"
            )
        return tensor.detach().to(device=self.device, dtype=meta.dtype).contiguous()


def check_metadata(source: Any, want: dict[str, TensorMeta]) -> None:
    """The source's ``metadata()`` names exactly the checkpoint tensors the engines load, with their shapes."""
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
