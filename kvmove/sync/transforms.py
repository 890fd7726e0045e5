"""Transforms (a registry): what a trainer rank serves for a plan entry, and what an engine rank does with the
bytes it pulled for it. The entry planner (kvmove.sync.planning.entries) picks a transform per entry by name; the
trainer's :func:`pack` and the engine's :class:`Lander` look it up here, so neither has a branch per kind.

- ``plain``: the trainer serves the region as the engine's loader reads it (a view of its tensor); the engine
  copies it into the region.
- ``trainer``: the trainer quantizes the entry's BF16 cover (with the other covers of the pull, batched:
  kvmove.sync.programs; Triton on CUDA; straight into the slot when the parts are the whole cover's) and serves
  the FP8 weight and scale parts of its regions; the engine copies each into its region.
- ``engine``: the trainer serves its BF16 piece of a cover; the engine stages it, and once every piece of the
  cover has landed quantizes the cover on its own device and copies the parts into their regions.

Both halves add their work to a program (kvmove.sync.programs) rather than run it one tensor at a time: a
pull's covers quantize in a few batched calls, its parts copy in a few strided copies, and a pull over memory
that outlives the sync replays the program built for it at init.

Both sides reach the same bits as the engine's own quantizer on the whole tensor: whole blocks quantize alone
to the whole tensor's bits (kvmove.quant.fp8).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from kvmove.quant import FP8_DTYPE, BlockQuantized, scale_shape
from kvmove.sync.planning.entries import ENGINE, PLAIN, TRAINER, Entry, EntryPlan
from kvmove.sync.planning.packing import PackLayout, ServeSpec, pack_layout, part_views, payload
from kvmove.sync.planning.plan import Box, Region, ShardingPlan, contiguous_strides
from kvmove.sync.planning.recording import StridedView
from kvmove.sync.planning.schedule import MappedSource
from kvmove.sync.programs import Program, ProgramBuilder


class Held(NamedTuple):
    """What a trainer rank reads an entry from: a tensor and the box of the HF tensor it is (full, or a shard)."""

    tensor: torch.Tensor
    box: Box


def read_box(box: Box, held: Held) -> torch.Tensor:
    """``box`` (of the HF tensor) as a view of ``held``."""
    return held.tensor[tuple(slice(a - o, b - o) for a, b, o in zip(box.start, box.stop, held.box.start, strict=True))]


# -- trainer halves: each adds what serving ``spec`` takes to a program, writing parts into ``dsts`` ----------------
def _serve_view(b: ProgramBuilder, spec: ServeSpec, held: Held, dsts: list[torch.Tensor]) -> bool:
    persistent = True
    for part, dst in zip(spec.parts, dsts, strict=True):
        data = payload(part, spec.shape, held.tensor)
        persistent &= data.untyped_storage().data_ptr() == held.tensor.untyped_storage().data_ptr()
        b.copy(dst.view(data.shape), data)
    return persistent  # an op chain that copied made a tensor of this sync only


def _serve_quantized(b: ProgramBuilder, spec: ServeSpec, held: Held, dsts: list[torch.Tensor]) -> bool:
    parts: list[PartDst] = [((p.part, p.src), d) for p, d in zip(spec.parts, dsts, strict=True)]
    quantize_cover(b, read_box(spec.box, held), spec.tensor, parts)
    return True


PartDst = tuple[tuple[str, StridedView | None], torch.Tensor]
"""A quantized cover's part (``"weight"`` or ``"scale"``, and a region's view inside it) and where it lands."""


def quantize_cover(b: ProgramBuilder, cover: torch.Tensor, name: str, parts: Sequence[PartDst]) -> None:
    """Adds quantizing ``cover`` into its parts' destinations (each ``((part, view in it), dst)``): straight into
    them, one kernel, when they are the whole cover's weight and scales (a slot's parts, or an engine's parameters
    for every expert and unsplit linear), else into scratch, each part then copied into its destination."""
    scales = scale_shape(cover.shape)
    whole: dict[str, torch.Tensor | None] = {}
    for (part, view), dst in parts:
        if _whole(view, cover.shape, scales, part):
            shape, dtype = (cover.shape, FP8_DTYPE) if part == "weight" else (scales, torch.float32)
            whole[part] = _viewed(dst, shape, dtype)
    weight, scale = whole.get("weight"), whole.get("scale")
    if len(parts) == 2 and weight is not None and scale is not None:
        b.quantize(cover, name, weight, scale)
        return

    def land(weight: torch.Tensor, scale: torch.Tensor) -> None:
        q = BlockQuantized(weight, scale)
        for (part, view), dst in parts:
            data = quantized_part(q, part, view)
            b.copy(dst if dst.shape == data.shape else dst.view(data.shape), data)

    b.quantize(cover, name, then=land)


def _whole(view: StridedView | None, shape: torch.Size, scales: tuple[int, ...], part: str) -> bool:
    """Whether ``view`` is all of the quantized cover's ``part``, in order (its bytes are the part's own)."""
    full = tuple(shape) if part == "weight" else scales
    return view is not None and (view.offset, tuple(view.shape), tuple(view.stride)) == (
        0,
        full,
        tuple(contiguous_strides(full)),
    )


def quantized_part(q: BlockQuantized, part: str, view: StridedView | None) -> torch.Tensor:
    """The region ``view`` reads of the ``part`` ("weight" or "scale") of a quantized cover."""
    assert view is not None, "a quantized part is a view of its cover's weight or scales"
    return view.apply(q.weight if part == "weight" else q.scale_inv)


def _serve_box(b: ProgramBuilder, spec: ServeSpec, held: Held, dsts: list[torch.Tensor]) -> bool:
    data = read_box(spec.box, held)
    b.copy(dsts[0].view(data.shape), data)
    return True


# -- engine halves -----------------------------------------------------------------------------------------------
class Patch(Protocol):
    """A delta-encoded pull in a receive slot (``kvmove.sync.delta.apply``): written straight into the
    parameters through a target built once per pull from its parts' destinations."""

    def target(self, dsts: Sequence[torch.Tensor]) -> Any: ...

    def apply(self, target: Any, buf: torch.Tensor) -> None: ...


class Lander:
    """The engine side of syncs: lands pulled entries in the parameters, assembling and quantizing covers.

    Pieces of one cover may arrive in several pulls (one per trainer rank holding a piece), all of one group;
    a cover is quantized, landed and dropped once its last piece arrives. A pull landed with a ``key`` (its
    pull and receive slot) whose entries only copy has its program kept and replayed in later syncs
    (:meth:`prepare` builds it at init). Not thread-safe: one loader at a time.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], plan: ShardingPlan, entries: EntryPlan) -> None:
        self.params, self.regions, self.entries = params, plan.regions, entries
        self._staged: dict[int, _Staged] = {}
        self._ready: list[int] = []
        self._programs: dict[Hashable, Program] = {}
        self._targets: dict[Hashable, Any] = {}
        self._accepts: dict[Hashable, bool] = {}

    @property
    def pending_covers(self) -> int:
        """Covers with pieces still missing (0 once a sync's pulls all landed)."""
        return len(self._staged)

    def reset(self) -> None:
        """Start a sync: drop covers a failed sync left half-assembled."""
        self._staged.clear()
        self._ready = []

    def prepare(self, entries: Sequence[Entry], buf: torch.Tensor, key: Hashable) -> None:
        """Build (at init) the program :meth:`land` replays for ``key`` when ``entries`` only copy, and run it once
        leaving the parameters as they are (``Program.warm`` with ``restore``: the slot first takes the bytes it
        lands), so its copy kernels load now, not in the first sync. The caller synchronizes."""
        if all(not TRANSFORMS[e.transform].stages for e in entries):
            program = self._programs[key] = self._program(entries, buf)
            program.warm(restore=True)

    def land(
        self, entries: Sequence[Entry], buf: torch.Tensor, key: Hashable | None = None, patch: Patch | None = None
    ) -> None:
        """Land ``entries`` (one pull's, packed as :func:`pack` packs them) from ``buf``; with a ``patch``
        (kvmove.sync.delta.apply), ``buf`` holds a delta of them, written into the parameters it changes."""
        if patch is not None:
            target = self._targets.get(key) if key is not None else None
            if target is None:
                target = patch.target(self.destinations(entries))
                if key is not None:
                    self._targets[key] = target
            patch.apply(target, buf)
        else:
            program = self._programs.get(key) if key is not None else None
            if program is None:
                program = self._program(entries, buf)
                if key is not None and program.persistent:
                    self._programs[key] = program
            program.run()
            self._quantize_ready()
        if buf.is_cuda:  # the slot is reusable, and the time real, only once the copies ran
            torch.cuda.current_stream(buf.device).synchronize()

    def accepts_delta(self, entries: Sequence[Entry], key: Hashable | None = None) -> bool:
        """Whether a delta of ``entries`` (one pull's; ``key`` caches the answer) can be written into the
        parameters: every part lands by a byte copy into a parameter that holds the last synced bytes."""
        if key is not None and key in self._accepts:
            return self._accepts[key]
        try:
            self.destinations(entries)
            ok = True
        except ValueError:
            ok = False
        if key is not None:
            self._accepts[key] = ok
        return ok

    def destinations(self, entries: Sequence[Entry]) -> list[torch.Tensor]:
        """Each part of ``entries`` (in payload order) as the parameter view it lands in: what a delta of them is
        written into. Refused for entries the engine stages (a delta is never taken of those)."""
        out = []
        for entry in entries:
            if TRANSFORMS[entry.transform].stages:
                raise ValueError(f"a delta lands only through copies; {entry.tensor} is staged")
            for i in entry.regions:
                dst = self._dst(self.regions[i])
                if dst.dtype != self.regions[i].dtype:
                    raise ValueError(f"a delta lands only byte copies; {entry.tensor} lands converted")
                out.append(dst)
        return out

    def _program(self, entries: Sequence[Entry], buf: torch.Tensor) -> Program:
        builder, persistent = ProgramBuilder(), True
        views = iter(part_views(buf, [n for e in entries for n in e.sizes]))
        for entry in entries:
            persistent &= TRANSFORMS[entry.transform].land(self, builder, entry, [next(views) for _ in entry.sizes])
        return builder.build(persistent)

    def copy(self, b: ProgramBuilder, entry: Entry, parts: list[torch.Tensor]) -> bool:
        for i, raw in zip(entry.regions, parts, strict=True):
            region = self.regions[i]
            b.copy(self._dst(region), raw.view(region.dtype).view(region.dst.shape))
        return True

    def stage(self, b: ProgramBuilder, entry: Entry, parts: list[torch.Tensor]) -> bool:
        cover = self.entries.covers[entry.cover]
        staged = self._staged.get(entry.cover)
        if staged is None:
            tensor = torch.empty(cover.box.shape, dtype=cover.dtype, device=parts[0].device)
            staged = self._staged[entry.cover] = _Staged(tensor, cover.pieces)
        piece = parts[0].view(cover.dtype).view(entry.box.shape)
        b.copy(read_box(entry.box, Held(staged.tensor, cover.box)), piece)
        staged.missing -= 1
        if staged.missing == 0:
            self._ready.append(entry.cover)
        return False  # staging memory lives for one sync

    def mapped_program(self, entries: Sequence[Entry], covers: Sequence[torch.Tensor]) -> Program:
        """The program of a mapped pull: each entry's cover quantized by this engine rank from ``covers`` (its BF16
        view in the serving rank's arena, mapped into this process: :func:`mapped_cover`) straight into the
        parameters (persistent: built at init, replayed every sync)."""
        builder = ProgramBuilder()
        for entry, cover in zip(entries, covers, strict=True):
            half = TRANSFORMS[entry.transform].mapped
            if half is None:
                raise ValueError(f"{entry.tensor}: a {entry.transform} entry is never quantized from a mapped arena")
            half(self, builder, entry, cover)
        return builder.build(persistent=True)

    def quantize_mapped(self, b: ProgramBuilder, entry: Entry, cover: torch.Tensor) -> bool:
        """Quantize ``cover`` (a view of the serving rank's mapped arena) into the parameters
        (:func:`quantize_cover`: in place where the regions are the whole cover's weight and scales)."""
        quantize_cover(b, cover, entry.tensor, self._parts(entry.regions))
        return True

    def _parts(self, regions: Sequence[int]) -> list[PartDst]:
        """The quantized part each of ``regions`` is, with the parameter view it lands in."""
        out: list[PartDst] = []
        for i in regions:
            part = self.entries.quant[i]
            assert part is not None, "a quantized cover's regions are parts of it"
            out.append(((part.part, part.view), self._dst(self.regions[i])))
        return out

    def _quantize_ready(self) -> None:
        if not self._ready:
            return
        builder = ProgramBuilder()
        for c in self._ready:
            cover, staged = self.entries.covers[c], self._staged.pop(c)
            quantize_cover(builder, staged.tensor, cover.tensor, self._parts(cover.regions))
        self._ready = []
        builder.build(persistent=False).run()

    def _dst(self, region: Region) -> torch.Tensor:
        return region.dst.apply(self.params[region.param].data)


def _viewed(t: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` as a view of ``shape`` when it has ``dtype`` and a view expresses it (else None: land by copies)."""
    if t.dtype != dtype:
        return None
    try:
        return t.view(tuple(shape))
    except RuntimeError:
        return None


def mapped_cover(arena: torch.Tensor, source: MappedSource, box: Box) -> torch.Tensor:
    """The cover ``box`` (of the HF tensor) as a view of a serving rank's arena mapped into this process
    (``Transport.mapped``): its raw shard at ``source.offset``, then the box inside the shard."""
    nbytes = source.shard.numel * source.dtype.itemsize
    shard = arena[source.offset : source.offset + nbytes].view(source.dtype).view(source.shard.shape)
    return read_box(box, Held(shard, source.shard))


@dataclass
class _Staged:
    """A cover being assembled on the engine: its BF16 box, and how many of its pieces have not landed yet."""

    tensor: torch.Tensor
    missing: int


# -- the registry --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transform:
    """One way an entry crosses the link: the trainer's half (``serve``) and the engine's (``land``)."""

    name: str
    summary: str
    quantizes: bool
    """The trainer quantizes the box it reads before serving the parts."""
    stages: bool
    """The engine assembles the entry with others before landing it (its landing is not replayed)."""
    serve: Callable[[ProgramBuilder, ServeSpec, Held, list[torch.Tensor]], bool]
    """Adds serving an entry into the slot parts to a program; whether all it reads outlives the sync."""
    land: Callable[[Lander, ProgramBuilder, Entry, list[torch.Tensor]], bool]
    """Adds landing an entry's parts to a program; whether all it writes outlives the sync."""
    mapped: Callable[[Lander, ProgramBuilder, Entry, torch.Tensor], bool] | None = None
    """Adds what the engine does instead when it maps the serving rank's arena (mapped pulls, for entries
    ``entries.mappable`` admits): quantize the cover's view there into the parameters; None: never mapped."""


TRANSFORMS: dict[str, Transform] = {
    t.name: t
    for t in (
        Transform(PLAIN, "served as the loader reads it", False, False, _serve_view, Lander.copy),
        Transform(
            TRAINER,
            "quantized on the trainer: only FP8 crosses (or, mapped, by the engine from the trainer's arena)",
            True,
            False,
            _serve_quantized,
            Lander.copy,
            Lander.quantize_mapped,
        ),
        Transform(ENGINE, "a BF16 piece of a cover the engine quantizes", False, True, _serve_box, Lander.stage),
    )
}


class PackProgram(NamedTuple):
    program: Program
    nbytes: int
    """The packed payload's bytes (with alignment)."""


def pack_program(slot: torch.Tensor, specs: Sequence[ServeSpec], held: Sequence[Held]) -> PackProgram:
    """What serving ``specs`` from what the trainer holds into ``slot`` takes: every cover of the pull quantized
    in batched calls (straight into the slot where a part is a whole cover's), every part copied in batches.
    Persistent (replayable) when everything is read from raw shards in the arena."""
    layout = pack_layout([n for s in specs for n in s.sizes])
    builder, persistent = ProgramBuilder(), True
    offsets = iter(layout.offsets)
    for spec, source in zip(specs, held, strict=True):
        dsts = [slot[(o := next(offsets)) : o + p.nbytes].view(p.dtype) for p in spec.parts]
        persistent &= TRANSFORMS[spec.transform].serve(builder, spec, source, dsts) and spec.shard
    return PackProgram(builder.build(persistent), layout.nbytes)


def pack(slot: torch.Tensor, specs: Sequence[ServeSpec], held: Sequence[Held]) -> PackLayout:
    """Serve each spec from what the trainer holds into ``slot`` (:func:`pack_program`, run once)."""
    pack_program(slot, specs, held).program.run()
    return pack_layout([n for s in specs for n in s.sizes])
