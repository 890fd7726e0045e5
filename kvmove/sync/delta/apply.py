"""The engine's side of a delta sync: the changed words of a pull scattered straight into the parameters.

A packed pull's parts land in parameter regions (``kvmove.sync.transforms.Lander``): part ``i`` holds, row-major,
the elements of one strided view of one parameter. A :class:`Scatter`, built once per pull from those views, maps
a position of the payload to its place in its parameter's storage (the part holding it by a search over the
parts' first positions, then the view's strides), and :meth:`Scatter.put` writes a delta's values there with
one indexed copy per run of parts that share a storage. Only the changed words are read or written: no dense
payload is assembled, and parameters outside the pull are never touched. All of it is batched torch work on the
slot's device (CUDA: no host synchronization but reading a bitmap's positions and the runs' bounds).

Where a part's element is narrower than a word (FP8 weights under int16 words) the words are split into bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmove.quant.quantizer import default_backend
from kvmove.sync.delta.diff import merged
from kvmove.sync.delta.encoding import Encoding, Words, payload_words, read


class Scatter(NamedTuple):
    """Where each position of one pull's payload lives in the engine's parameters (built once, replayed)."""

    unit: torch.dtype
    """What it writes: the payload's word, or bytes where a part's element is narrower."""
    split: int
    """Units per word (2: int16 words written as bytes)."""
    bounds: torch.Tensor
    """Each part's first position, then the payload's end, in units (int64, ascending)."""
    shifts: torch.Tensor
    """Per part: its first unit in its storage less its first position (contiguous parts: position + shift)."""
    geometry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """Strided parts: each part's units per element, and its merged shape and strides (padded to one rank); None
    where every part is contiguous."""
    storages: tuple[torch.Tensor, ...]
    """Every storage the pull lands in, as one flat tensor of units."""
    runs: tuple[int, ...]
    """The storage of each run of consecutive parts that share one."""
    run_starts: torch.Tensor
    """Each run's first position, in units."""
    flat_shifts: torch.Tensor | None
    """Per part: its first unit counted from the first storage's first unit, less its first position, where every
    part is contiguous and whole words (:mod:`kvmove.sync.delta.triton_apply` writes them all in one launch)."""

    @classmethod
    def of(cls, dsts: Sequence[torch.Tensor], words: Words) -> Scatter:
        """The scatter of a pull whose parts with bytes land in ``dsts`` (in payload order)."""
        narrow = any(d.element_size() % words.word_bytes for d in dsts)
        unit, split = (torch.uint8, words.word_bytes) if narrow else (words.dtype, 1)
        size = unit.itemsize
        flats: dict[int, int] = {}
        storages: list[torch.Tensor] = []
        runs: list[int] = []
        run_starts: list[int] = []
        for d, span in zip(dsts, words.parts, strict=True):
            storage = d.untyped_storage()
            s = flats.setdefault(storage.data_ptr(), len(storages))
            if s == len(storages):
                n = storage.nbytes() // size
                storages.append(torch.empty(0, dtype=unit, device=d.device).set_(storage, 0, (n,), (1,)))
            if not runs or runs[-1] != s:
                runs.append(s)
                run_starts.append(span.start * split)
        device = dsts[0].device
        starts = [p.start * split for p in words.parts]
        bounds = torch.tensor([*starts, words.words * split], dtype=torch.int64, device=device)
        bases = [d.storage_offset() * d.element_size() // size for d in dsts]
        shifts = torch.tensor([b - a for a, b in zip(starts, bases, strict=True)], dtype=torch.int64, device=device)
        geometry = None if all(d.is_contiguous() for d in dsts) else _geometry(dsts, size)
        run_at = torch.tensor(run_starts, dtype=torch.int64, device=device)
        flat = None
        if geometry is None and split == 1:
            base = storages[0].data_ptr()
            parts = [flats[d.untyped_storage().data_ptr()] for d in dsts]
            origin = [(storages[s].data_ptr() - base) // size for s in parts]
            flat = torch.tensor([o + b - a for o, a, b in zip(origin, starts, bases, strict=True)], device=device)
        return cls(unit, split, bounds, shifts, geometry, tuple(storages), tuple(runs), run_at, flat)

    def put(self, positions: torch.Tensor, values: torch.Tensor, backend: str | None = None) -> None:
        """Write ``values`` (words) at ``positions`` (int64, ascending) of the payload into the parameters.

        ``backend``: ``torch`` or ``triton`` (one launch; only where :attr:`flat_shifts` is set); by default
        Triton for CUDA tensors where it is installed and applies."""
        if self.flat_shifts is not None and (backend or default_backend(positions)) == "triton":
            from kvmove.sync.delta.triton_apply import scatter

            scatter(self.storages[0], positions, values.view(self.unit), self.bounds, self.flat_shifts)
            return
        if self.split > 1:
            positions = positions.unsqueeze(1) * self.split + torch.arange(self.split, device=positions.device)
            positions = positions.flatten()
        values, k = values.view(self.unit), positions.numel()
        counts = torch.diff(torch.searchsorted(positions, self.bounds))  # positions are ascending: per part
        if self.geometry is None:
            at = positions + torch.repeat_interleave(self.shifts, counts, output_size=k)
        else:
            part = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=k)
            start = self.bounds[part]
            at = start + self.shifts[part] + _strided(positions - start, part, *self.geometry)
        if len(self.runs) == 1:
            self.storages[self.runs[0]].index_copy_(0, at, values)
            return
        bounds = [*torch.searchsorted(positions, self.run_starts).tolist(), positions.numel()]
        for s, lo, hi in zip(self.runs, bounds, bounds[1:], strict=False):
            if hi > lo:
                self.storages[s].index_copy_(0, at[lo:hi], values[lo:hi])


def _geometry(dsts: Sequence[torch.Tensor], size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shapes = [merged(d.shape, d.stride()) for d in dsts]
    rank = max(len(s) for s, _ in shapes)
    pad = [((1,) * (rank - len(s)) + s, (0,) * (rank - len(t)) + t) for s, t in shapes]
    device = dsts[0].device
    per = torch.tensor([d.element_size() // size for d in dsts], device=device)
    return per, torch.tensor([s for s, _ in pad], device=device), torch.tensor([t for _, t in pad], device=device)


def _strided(
    rel: torch.Tensor, part: torch.Tensor, per: torch.Tensor, shape: torch.Tensor, stride: torch.Tensor
) -> torch.Tensor:
    """Units from a part's start (row-major in the payload) -> units from its view's first element."""
    per = per[part]
    element, within = rel // per, rel % per
    out, rest = torch.zeros_like(rel), element
    for d in range(shape.shape[1] - 1, -1, -1):
        n = shape[part, d]
        out += (rest % n) * stride[part, d]
        rest = rest // n
    return out * per + within


class Patch(NamedTuple):
    """A delta-encoded pull as the engine received it: its encoding, changed words and payload layout."""

    encoding: Encoding
    changed: int
    words: Words

    @classmethod
    def of(cls, encoding: str, changed: int, sizes: Sequence[int]) -> Patch | None:
        """The patch of a pull whose parts have ``sizes`` bytes, packed as ``encoding`` (None: dense, landed as
        it is)."""
        if Encoding(encoding) is Encoding.DENSE:
            return None
        return cls(Encoding(encoding), changed, payload_words(sizes))

    def target(self, dsts: Sequence[torch.Tensor]) -> Scatter:
        """Where this pull's words land, given each part's destination."""
        return Scatter.of([d for d in dsts if d.numel()], self.words)

    def apply(self, target: Scatter, buf: torch.Tensor, backend: str | None = None) -> None:
        """Write the delta in ``buf`` into the parameters ``target`` maps the payload to (``backend``:
        :meth:`Scatter.put`'s)."""
        delta = read(buf, self.words, self.encoding, self.changed)
        target.put(delta.positions, delta.values, backend)
