"""Bounded staging for the updates of a vLLM worker (pure planning: no vLLM, no bytes).

Where vLLM's post-load processing of a module is not the identity (CPU-packed linears, prepacked MoE experts,
quantized layers), the bytes an update brings for it must first sit in the module's *unprocessed* form. Those
parameters are *staged*; all others land in the live parameters directly. Staged parameters are grouped into
commit *units* (the staged parameters of one decoder layer; outside the layers, of one module), and a unit's
unprocessed tensors live in one slot of a *window*: a unit takes its slot when its first bytes land and gives it
back once it is complete, processed and committed into the live model. So the staging memory is
``slots * slot_bytes`` (the largest unit), whatever the model's size.

A unit's slot is fixed (its ordinal among the units, modulo the slot count), so the receive programs a sync
replays write to the same addresses every sync; :func:`slots_needed` finds how many slots a sync's landing
order needs for no unit to take a slot another still holds (one, for pulls grouped by decoder blocks).
:func:`check_received` validates what an update brought before any module changes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from kvmove.errors import KvmoveError
from kvmove.sync.planning.plan import ParamMeta, Region

ALIGN = 256
"""Byte alignment of every staged tensor inside a slot (what CUDA kernels and oneDNN expect of a weight)."""


class Unit(NamedTuple):
    """The staged parameters one commit processes together."""

    key: str
    params: tuple[str, ...]
    nbytes: int
    """Bytes of its unprocessed tensors in a slot (each aligned to :data:`ALIGN`)."""


class WindowLayout(NamedTuple):
    """Where every staged parameter lies in the window: slot ``slot_of[unit]``, ``offsets[param]`` into it."""

    units: dict[str, Unit]
    slots: int
    slot_bytes: int
    offsets: dict[str, int]
    slot_of: dict[str, int]

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def unit_of(self, param: str) -> str | None:
        """The unit staging ``param`` (None: it lands in the live model directly)."""
        return unit_key(param) if param in self.offsets else None


def unit_key(param: str) -> str:
    """The commit unit of parameter ``param``: its decoder layer (``model.layers.3``) inside the layers, else
    its module (``model.embed_tokens``)."""
    parts = param.split(".")
    if "layers" in parts:
        i = parts.index("layers") + 1
        if i < len(parts) and parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or param


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def param_bytes(p: ParamMeta) -> int:
    return p.numel * p.dtype.itemsize


def staging_units(params: Sequence[ParamMeta], staged: Collection[str]) -> dict[str, Unit]:
    """The units of the ``staged`` parameters, in model order (the order of ``params``)."""
    members: dict[str, list[ParamMeta]] = {}
    for p in params:
        if p.name in staged:
            members.setdefault(unit_key(p.name), []).append(p)
    return {
        k: Unit(k, tuple(p.name for p in ps), sum(aligned(param_bytes(p)) for p in ps)) for k, ps in members.items()
    }


def window_layout(units: Mapping[str, Unit], params: Sequence[ParamMeta], slots: int = 1) -> WindowLayout:
    """``units`` laid out in a window of ``slots`` slots of the largest unit's bytes."""
    metas = {p.name: p for p in params}
    offsets: dict[str, int] = {}
    for unit in units.values():
        at = 0
        for name in unit.params:
            offsets[name] = at
            at += aligned(param_bytes(metas[name]))
    slot_bytes = max((u.nbytes for u in units.values()), default=0)
    slot_of = {k: i % max(slots, 1) for i, k in enumerate(units)}
    return WindowLayout(dict(units), max(slots, 1) if units else 0, slot_bytes, offsets, slot_of)


def slots_needed(order: Iterable[str], expected: Mapping[str, int], units: Sequence[str]) -> int:
    """The fewest window slots under which landing ``order`` (the unit of each staged entry, as landed) never gives
    a unit a slot another unit still holds; a unit holds its slot from its first entry until all ``expected[unit]``
    of its entries landed. ``units``: every unit in model order (a unit's slot is its ordinal modulo the slots)."""
    seq = list(order)
    for slots in range(1, max(len(units), 1) + 1):
        if _fits(seq, expected, units, slots):
            return slots
    return max(len(units), 1)


def _fits(order: list[str], expected: Mapping[str, int], units: Sequence[str], slots: int) -> bool:
    ordinal = {u: i for i, u in enumerate(units)}
    holder: dict[int, str] = {}
    landed: dict[str, int] = {}
    for unit in order:
        slot = ordinal[unit] % slots
        if holder.get(slot, unit) != unit:
            return False
        holder[slot] = unit
        landed[unit] = landed.get(unit, 0) + 1
        if landed[unit] == expected[unit]:
            del holder[slot]
    return True


class Budget(NamedTuple):
    """What a worker may spend on staging: ``nbytes`` (0: one slot of the largest unit)."""

    nbytes: int = 0

    def check(self, layout: WindowLayout, why: str) -> None:
        """A clear error if ``layout`` does not fit this budget."""
        if self.nbytes and layout.nbytes > self.nbytes:
            raise KvmoveError(
                f"kvmove staging needs {layout.slots} slot(s) of {layout.slot_bytes} bytes ({why}), over the "
                f"staging budget of {self.nbytes} bytes: raise staging_bytes, or sync with a strategy that "
                "groups pulls by decoder blocks (v3) so that one unit completes before the next starts"
            )


class Problem(NamedTuple):
    tensor: str
    why: str


def check_received(
    regions: Sequence[Region],
    received: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    shapes: Mapping[str, tuple[int, ...]],
    staged: Collection[str],
    fillable: Callable[[str], bool],
) -> list[Problem]:
    """What is wrong with an update that brought ``received`` (HF name -> shape, dtype), before anything changes:
    names no region reads, shapes and dtypes other than the checkpoint's, and staged parameters it fills only in
    part whose other part cannot be rebuilt (``fillable(param)`` false: not readable from the live model)."""
    by_name: dict[str, list[Region]] = {}
    for r in regions:
        by_name.setdefault(r.hf_name, []).append(r)
    problems = [Problem(n, "no parameter of this engine reads it") for n in received if n not in by_name]
    for name, (shape, dtype) in received.items():
        if name not in by_name:
            continue
        want = shapes.get(name)
        if want is not None and tuple(shape) != tuple(want):
            problems.append(Problem(name, f"shape {tuple(shape)}, the checkpoint's is {tuple(want)}"))
        if dtype != by_name[name][0].dtype:
            problems.append(Problem(name, f"dtype {dtype}, the engine loads {by_name[name][0].dtype}"))
    touched = {r.param for n in received for r in by_name.get(n, ())}
    for param in sorted(touched & set(staged)):
        missing = sorted({r.hf_name for r in regions if r.param == param and r.hf_name not in received})
        if missing and not fillable(param):
            problems.append(Problem(missing[0], f"{param} needs it too (its live value cannot be read back)"))
    return problems


def describe(problems: Sequence[Problem]) -> str:
    shown = "; ".join(f"{p.tensor}: {p.why}" for p in problems[:4])
    return shown + (f"; ... ({len(problems)} problems)" if len(problems) > 4 else "")
