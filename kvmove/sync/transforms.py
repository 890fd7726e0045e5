"""Transforms (a registry): what a trainer rank serves for a plan entry, and what an engine rank does with the
bytes it pulled for it. The entry planner (kvmove.sync.planning.entries) picks a transform per entry by name; the
trainer's :func:`pack` and the engine's :class:`Lander` look it up here, so neither has a branch per kind.

- ``plain``: the trainer serves the region as the engine's loader reads it (a view of its tensor); the engine
  copies it into the region.
- ``trainer``: the trainer quantizes the entry's BF16 cover (with the other covers of the pull, batched:
  kvmove.quant.batch; Triton on CUDA) and serves the FP8 weight and scale parts of its regions; the engine
  copies each into its region.
- ``engine``: the trainer serves its BF16 piece of a cover; the engine stages it, and once every piece of the
  cover has landed quantizes the cover on its own device and copies the parts into their regions.

Both sides reach the same bits as the engine's own quantizer on the whole tensor: whole blocks quantize alone
to the whole tensor's bits (kvmove.quant.fp8).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvmove.quant import BlockQuantized
from kvmove.quant.batch import quantize_many
from kvmove.sync.planning.entries import ENGINE, PLAIN, TRAINER, Entry, EntryPlan
from kvmove.sync.planning.packing import PackLayout, ServeSpec, pack_layout, part_views, payload
from kvmove.sync.planning.plan import Box, Region, ShardingPlan
from kvmove.sync.planning.recording import StridedView


class Held(NamedTuple):
    """What a trainer rank reads an entry from: a tensor and the box of the HF tensor it is (full, or a shard)."""

    tensor: torch.Tensor
    box: Box


def read_box(box: Box, held: Held) -> torch.Tensor:
    """``box`` (of the HF tensor) as a view of ``held``."""
    return held.tensor[tuple(slice(a - o, b - o) for a, b, o in zip(box.start, box.stop, held.box.start, strict=True))]


# -- trainer halves ----------------------------------------------------------------------------------------------
def _serve_view(spec: ServeSpec, held: Held, _: BlockQuantized | None) -> list[torch.Tensor]:
    return [payload(part, spec.shape, held.tensor) for part in spec.parts]


def _serve_quantized(spec: ServeSpec, _: Held, q: BlockQuantized | None) -> list[torch.Tensor]:
    assert q is not None
    return [quantized_part(q, part.part, part.src) for part in spec.parts]


def quantized_part(q: BlockQuantized, part: str, view: StridedView | None) -> torch.Tensor:
    """The region ``view`` reads of the ``part`` ("weight" or "scale") of a quantized cover."""
    assert view is not None, "a quantized part is a view of its cover's weight or scales"
    return view.apply(q.weight if part == "weight" else q.scale_inv)


def _serve_box(spec: ServeSpec, held: Held, _: BlockQuantized | None) -> list[torch.Tensor]:
    return [read_box(spec.box, held)]


# -- engine halves -----------------------------------------------------------------------------------------------
class Lander:
    """The engine side of one sync: lands pulled entries in the parameters, assembling and quantizing covers.

    Pieces of one cover may arrive in several pulls (one per trainer rank holding a piece), all of one group;
    a cover is quantized, landed and dropped once its last piece arrives. Not thread-safe: one loader at a time.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], plan: ShardingPlan, entries: EntryPlan) -> None:
        self.params, self.regions, self.entries = params, plan.regions, entries
        self._staged: dict[int, _Staged] = {}
        self._ready: list[int] = []

    @property
    def pending_covers(self) -> int:
        """Covers with pieces still missing (0 once a sync's pulls all landed)."""
        return len(self._staged)

    def land(self, entries: Sequence[Entry], buf: torch.Tensor) -> None:
        """Land ``entries`` (one pull's, packed as :func:`pack` packs them) from ``buf``."""
        views = iter(part_views(buf, [n for e in entries for n in e.sizes]))
        for entry in entries:
            TRANSFORMS[entry.transform].land(self, entry, [next(views) for _ in entry.sizes])
        self._quantize_ready()
        if buf.is_cuda:  # the slot is reusable, and the time real, only once the copies ran
            torch.cuda.current_stream(buf.device).synchronize()

    def copy(self, entry: Entry, parts: list[torch.Tensor]) -> None:
        for i, raw in zip(entry.regions, parts, strict=True):
            region = self.regions[i]
            self._write(region, raw.view(region.dtype).view(region.dst.shape))

    def stage(self, entry: Entry, parts: list[torch.Tensor]) -> None:
        cover = self.entries.covers[entry.cover]
        staged = self._staged.get(entry.cover)
        if staged is None:
            tensor = torch.empty(cover.box.shape, dtype=cover.dtype, device=parts[0].device)
            staged = self._staged[entry.cover] = _Staged(tensor, cover.pieces)
        piece = parts[0].view(cover.dtype).view(entry.box.shape)
        read_box(entry.box, Held(staged.tensor, cover.box)).copy_(piece, non_blocking=True)
        staged.missing -= 1
        if staged.missing == 0:
            self._ready.append(entry.cover)

    def _quantize_ready(self) -> None:
        if not self._ready:
            return
        covers = [self.entries.covers[c] for c in self._ready]
        staging = [self._staged.pop(c).tensor for c in self._ready]
        self._ready = []
        for cover, q in zip(covers, quantize_many(staging, [c.tensor for c in covers]), strict=True):
            for i, part in zip(cover.regions, cover.parts, strict=True):
                self._write(self.regions[i], quantized_part(q, part.part, part.view))

    def _write(self, region: Region, data: torch.Tensor) -> None:
        region.dst.apply(self.params[region.param].data).copy_(data, non_blocking=True)


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
    """The trainer quantizes the box it reads before serving the parts (``serve`` gets the result)."""
    serve: Callable[[ServeSpec, Held, BlockQuantized | None], list[torch.Tensor]]
    land: Callable[[Lander, Entry, list[torch.Tensor]], None]


TRANSFORMS: dict[str, Transform] = {
    t.name: t
    for t in (
        Transform(PLAIN, "served as the loader reads it", False, _serve_view, Lander.copy),
        Transform(TRAINER, "quantized on the trainer: FP8 crosses the link", True, _serve_quantized, Lander.copy),
        Transform(ENGINE, "a BF16 piece of a cover the engine quantizes", False, _serve_box, Lander.stage),
    )
}


def pack(slot: torch.Tensor, specs: Sequence[ServeSpec], held: Sequence[Held]) -> PackLayout:
    """Serve each spec from what the trainer holds into ``slot``, quantizing every cover of the pull at once."""
    layout = pack_layout([n for s in specs for n in s.sizes])
    quant = [k for k, s in enumerate(specs) if TRANSFORMS[s.transform].quantizes]
    covers = quantize_many([read_box(specs[k].box, held[k]) for k in quant], [specs[k].tensor for k in quant])
    quantized: dict[int, BlockQuantized] = dict(zip(quant, covers, strict=True))
    offsets = iter(layout.offsets)
    for k, (spec, source) in enumerate(zip(specs, held, strict=True)):
        served = TRANSFORMS[spec.transform].serve(spec, source, quantized.get(k))
        for part, data in zip(spec.parts, served, strict=True):
            off = next(offsets)
            slot[off : off + part.nbytes].view(part.dtype).view(data.shape).copy_(data)
    return layout
