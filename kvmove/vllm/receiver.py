"""Where a vLLM worker's pulled bytes land: the live parameters, or a bounded staging window committed unit by unit.

The puller's target (:class:`ReceiveTarget`) names every parameter of the plan: a parameter whose post-load
processing is the identity is the live parameter itself (bytes land in place); a staged one is a view into the
:class:`Window` (kvmove.vllm.staging). :class:`StagedLander` lands a pull's entries chunk by chunk, one
commit unit at a time: before a unit's first bytes it asks the :class:`Stager` to open it (its slot must be free;
an update that carries only part of the unit first fills the slot from the live model), and after each chunk it
counts what landed; the chunk that completes a unit commits it (vLLM's processing, then the live model) before the
next chunk lands. On a background loader thread (v3: ``Overlap.background_load``) that commit runs while the next
pull is read, on the loader's CUDA stream where there is one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.sync.planning.entries import Entry, EntryPlan
from kvmove.sync.planning.packing import part_views
from kvmove.sync.planning.plan import ParamMeta, ShardingPlan
from kvmove.sync.planning.schedule import PullPlan
from kvmove.sync.programs import Program, ProgramBuilder
from kvmove.sync.ranks.control import EngineStats
from kvmove.sync.ranks.engine import EngineRank, interleaved
from kvmove.sync.strategies import Strategy
from kvmove.sync.transforms import TRANSFORMS, Lander
from kvmove.vllm.staging import Budget, WindowLayout, param_bytes, slots_needed, window_layout

Commit = Callable[[str, Mapping[str, torch.Tensor]], None]
"""Process the unit's modules from its staged tensors and commit them into the live model."""
Fill = Callable[[str, Mapping[str, torch.Tensor]], None]
"""Write a unit's current (unprocessed) values into its staged tensors, from the live model."""


class Window:
    """The staging window's memory (allocated once) and each staged parameter's view into it."""

    def __init__(self, layout: WindowLayout, params: Sequence[ParamMeta], device: str | torch.device) -> None:
        self.layout = layout
        self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        metas = {p.name: p for p in params}
        self.views: dict[str, torch.Tensor] = {}
        for unit in layout.units.values():
            base = layout.slot_of[unit.key] * layout.slot_bytes
            for name in unit.params:
                m, at = metas[name], base + layout.offsets[name]
                self.views[name] = self.buffer[at : at + param_bytes(m)].view(m.dtype).view(m.shape)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def unit_views(self, unit: str) -> dict[str, torch.Tensor]:
        return {p: self.views[p] for p in self.layout.units[unit].params}


class ReceiveTarget(nn.Module):
    """What the puller writes: the live parameter where processing is the identity, else the window's view (the
    names and shapes of the plan's unprocessed parameters)."""

    def __init__(self, stager: Stager) -> None:
        super().__init__()
        self._stager = stager

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        yield from self._stager.targets().items()


class Stager:
    """One worker's staged commits across updates: which units an update expects, which are open, which done."""

    def __init__(self, window: Window, live: Mapping[str, torch.Tensor], commit: Commit, fill: Fill) -> None:
        self.window, self.live, self._commit, self._fill = window, dict(live), commit, fill
        self.expected: dict[str, int] = {}
        self.partial: frozenset[str] = frozenset()
        self.landed: dict[str, int] = {}
        self.holders: dict[int, str] = {}
        self.committed: list[str] = []
        self.lock = threading.Lock()

    def targets(self) -> dict[str, torch.Tensor]:
        """Every plan parameter's destination: live (identity processing) or the window's view."""
        return {**self.live, **self.window.views}

    def grow(self, slots: int, params: Sequence[ParamMeta]) -> bool:
        """Re-lay the window with ``slots`` slots if it has fewer (between updates only); whether it changed."""
        if slots <= self.window.layout.slots:
            return False
        layout = self.window.layout
        self.window = Window(window_layout(layout.units, params, slots), params, self.window.buffer.device)
        return True

    def begin(self, expected: Mapping[str, int], partial: frozenset[str] = frozenset()) -> None:
        """A new update: ``expected[unit]`` chunks of entries land per unit; ``partial`` units are filled first."""
        with self.lock:
            self.expected, self.partial = dict(expected), partial
            self.landed, self.holders, self.committed = {}, {}, []

    def enter(self, unit: str) -> None:
        """Before ``unit``'s bytes land: its slot is free or already its own (filled first if partial)."""
        with self.lock:
            slot = self.window.layout.slot_of[unit]
            holder = self.holders.get(slot)
            if holder == unit:
                return
            if unit in self.committed:
                raise KvmoveError(f"kvmove staging: {unit} received bytes after it was committed in this update")
            if holder is not None:
                raise KvmoveError(
                    f"kvmove staging: {unit} needs window slot {slot}, still held by {holder} (incomplete): this "
                    "update lands more units at once than the window has slots"
                )
            if unit in self.partial:
                self._fill(unit, self.window.unit_views(unit))
            self.holders[slot] = unit

    def count(self, unit: str, n: int) -> None:
        """``n`` entries of ``unit`` landed; the one completing it commits it into the live model."""
        with self.lock:
            self.landed[unit] = self.landed.get(unit, 0) + n
            want = self.expected.get(unit)
            if want is None:
                raise KvmoveError(f"kvmove staging: {unit} received bytes this update did not announce")
            if self.landed[unit] < want:
                return
            self._commit(unit, self.window.unit_views(unit))
            del self.holders[self.window.layout.slot_of[unit]]
            self.committed.append(unit)

    def missing(self) -> list[str]:
        """Units this update expects that are not committed (empty once it is complete)."""
        return [u for u in self.expected if u not in self.committed]


def unit_counts(entries: Sequence[Entry], unit_of: Callable[[Entry], str | None]) -> dict[str, int]:
    """How many entries of each unit ``entries`` land (what :meth:`Stager.count` is told in total)."""
    out: dict[str, int] = {}
    for e in entries:
        unit = unit_of(e)
        if unit is not None:
            out[unit] = out.get(unit, 0) + 1
    return out


class StagedLander(Lander):
    """A :class:`~kvmove.sync.transforms.Lander` that lands a pull unit by unit through a :class:`Stager`."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], plan: ShardingPlan, entries: EntryPlan, stager: Stager
    ) -> None:
        super().__init__(params, plan, entries)
        self.stager = stager
        self.expected: dict[str, int] = {}

    def unit_of(self, entry: Entry) -> str | None:
        regions = entry.regions or self.entries.covers[entry.cover].regions
        return self.stager.window.layout.unit_of(self.regions[regions[0]].param) if regions else None

    def reset(self) -> None:
        super().reset()
        self.stager.begin(self.expected)

    def accepts_delta(self, entries: Sequence[Entry], key: Hashable | None = None) -> bool:
        """A delta lands only in parameters vLLM serves as loaded (no unit): a staged unit's window does not hold
        the live bytes a delta patches, so such pulls are asked for whole."""
        return all(self.unit_of(e) is None for e in entries) and super().accepts_delta(entries, key)

    def _chunks(self, entries: Sequence[Entry], buf: torch.Tensor) -> list[tuple[str | None, list[Any]]]:
        views = iter(part_views(buf, [n for e in entries for n in e.sizes]))
        chunks: list[tuple[str | None, list[Any]]] = []
        for e in entries:
            parts, unit = [next(views) for _ in e.sizes], self.unit_of(e)
            if chunks and chunks[-1][0] == unit:
                chunks[-1][1].append((e, parts))
            else:
                chunks.append((unit, [(e, parts)]))
        return chunks

    def _build(self, items: Sequence[tuple[Entry, list[torch.Tensor]]]) -> Program:
        builder, persistent = ProgramBuilder(), True
        for entry, parts in items:
            persistent &= TRANSFORMS[entry.transform].land(self, builder, entry, parts)
        return builder.build(persistent)

    def prepare(self, entries: Sequence[Entry], buf: torch.Tensor, key: Hashable) -> None:
        for k, (_, items) in enumerate(self._chunks(entries, buf)):
            if all(not TRANSFORMS[e.transform].stages for e, _ in items):
                program = self._programs[(key, k)] = self._build(items)
                program.warm(restore=True)

    def land(
        self, entries: Sequence[Entry], buf: torch.Tensor, key: Hashable | None = None, patch: object | None = None
    ) -> None:
        if patch is not None:  # a delta (kvmove.sync.delta): asked for only where no part is staged (accepts_delta)
            if not self.accepts_delta(entries):
                raise KvmoveError(
                    "kvmove staging: a delta of a pull with staged parameters cannot land (it is asked dense)"
                )
            super().land(entries, buf, key, patch)  # type: ignore[arg-type]
            return
        for k, (unit, items) in enumerate(self._chunks(entries, buf)):
            program = self._programs.get((key, k)) if key is not None else None
            if program is None:
                program = self._build(items)
                if key is not None and program.persistent:
                    self._programs[(key, k)] = program
            if unit is not None:
                self.stager.enter(unit)
            program.run()
            self._quantize_ready()
            if buf.is_cuda:  # the staged bytes are in place before processing reads them
                torch.cuda.current_stream(buf.device).synchronize()
            if unit is not None:
                self.stager.count(unit, len(items))


class StagedRank(EngineRank):
    """An engine rank whose packed pulls land through a :class:`StagedLander` (one per strategy)."""

    def __init__(self, model: nn.Module, plan: ShardingPlan, recv: Any, stager: Stager, budget: Budget) -> None:
        super().__init__(model, plan, recv)
        self.stager, self.budget = stager, budget

    def run_sync(self, sync_id: int, strategy: Strategy, pulls: PullPlan, client: Any, **kw: Any) -> EngineStats:
        """A sync, once the window has the slots this strategy's landing order needs (within the budget)."""
        slots = self.slots_for(strategy, pulls)
        need = window_layout(self.stager.window.layout.units, self.plan.params, slots)
        self.budget.check(need, f"the landing order of {strategy.name}")  # before anything is allocated or lands
        if self.stager.grow(slots, self.plan.params):
            self._landers.clear()  # their programs wrote into the old window
            self.params = self.stager.targets()  # type: ignore[assignment]
        return super().run_sync(sync_id, strategy, pulls, client, **kw)

    def slots_for(self, strategy: Strategy, pulls: PullPlan) -> int:
        """Window slots the landing order of ``strategy``'s packed pulls needs (kvmove.vllm.staging)."""
        lander = self.lander(strategy.name, pulls)
        assert isinstance(lander, StagedLander) and pulls.plan is not None
        order = sorted((i for i, p in enumerate(pulls.pulls) if p.packed), key=lambda i: pulls.pulls[i].group)
        if strategy.overlap.interleave:
            order = interleaved(pulls.pulls, order)
        units = [u for i in order for k in pulls.pulls[i].entries if (u := lander.unit_of(pulls.plan.entries[k]))]
        return slots_needed(units, lander.expected, list(self.stager.window.layout.units))

    def lander(self, strategy: str, pulls: PullPlan) -> Lander:
        if pulls.plan is None:
            raise KvmoveError(f"engine rank {pulls.engine}: its pull plan carries no entries")
        kept = self._landers.get(strategy)
        if kept is None or kept[0] is not pulls:
            lander = StagedLander(self.stager.targets(), self.plan, pulls.plan, self.stager)
            staged = [pulls.plan.entries[k] for p in pulls.pulls if p.packed for k in p.entries]
            lander.expected = unit_counts(staged, lander.unit_of)
            if any(lander.unit_of(pulls.plan.entries[k]) for p in pulls.pulls if p.direct for k in p.entries):
                raise KvmoveError("kvmove staging: a direct pull writes a staged parameter (the plan marks them)")
            kept = self._landers[strategy] = (pulls, lander)
        return kept[1]
