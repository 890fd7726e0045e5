"""Pull programs: the device work of one packed pull, planned once as a few batched steps and replayed.

Packing a pull on the trainer (quantize its covers, copy every part into the slot) and landing it on the engine
(copy every part into its region) is the same work every sync: the same plan, the same arena and parameter
views, the same registered slots. A :class:`Program` holds that work as batched steps:

- quantizations of covers that are evenly spaced views of one storage (a layer's experts back to back in the
  arena) with outputs evenly spaced too, as one ``(n, R, C)`` call each (one Triton launch on CUDA), written
  straight into the slot when a part is the whole cover's weight or scales (no further copy), else into scratch;
- copies of same-shaped parts whose sources and destinations are both evenly spaced (every expert's projection
  out of the slot into a fused ``w13``), as one strided copy each.

:func:`kvmove.quant.batch.stacked_runs` finds those runs. Running a program synchronizes at most once: the
finiteness of every scale it computed is read back in one go. Programs over persistent memory (raw shards in the
arena, registered slots, parameters) are built once at init and replayed; others are built per pull.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvmove.quant import FP8_DTYPE, NonFiniteWeightError, scale_shape
from kvmove.quant.batch import MAX_BATCH_ELEMENTS, stacked_runs
from kvmove.quant.quantizer import default_backend, non_finite_blocks, quantize_into


@dataclass(frozen=True)
class QuantizeStep:
    """Quantize the ``(n, R, C)`` stack ``src`` into ``weight`` and ``scale`` (views of a slot or of scratch)."""

    src: torch.Tensor
    weight: torch.Tensor
    scale: torch.Tensor
    name: str


@dataclass(frozen=True)
class CopyStep:
    dst: torch.Tensor
    src: torch.Tensor


@dataclass(frozen=True)
class Program:
    """Quantizations, then copies (which may read what the quantizations wrote)."""

    quantize: tuple[QuantizeStep, ...]
    copies: tuple[CopyStep, ...]
    persistent: bool
    """Every view is of memory that outlives the sync (so the program may be replayed in later syncs)."""
    scratch_bytes: int = 0
    """Scratch it allocated for quantized covers whose parts are not all of them (held while it is kept)."""

    @property
    def launches(self) -> int:
        return len(self.quantize) + len(self.copies)

    def run(self, check: bool = True) -> None:
        """Run the steps (on the current stream); with ``check``, NonFiniteWeightError if a quantized block held
        inf or NaN: reading that back is the program's one host synchronization (none without quantizations)."""
        for q in self.quantize:
            quantize_into(q.src, q.weight, q.scale, name=q.name)
        for c in self.copies:
            c.dst.copy_(c.src, non_blocking=True)
        if check:
            check_finite([self])

    def warm(self, restore: bool = False) -> None:
        """Run every step once at init, the finiteness check's reduction included but not read back (the memory may
        hold any bits then): so that a first sync launches nothing for the first time (Triton kernels compile,
        lazily loaded CUDA kernels load, each stream's allocator pool gets its block) and costs what the next do.

        ``restore``: the destinations (an engine's live parameters) end as they were. A program that only copies
        first copies every destination back into its source, so the copies then write back the bytes already there
        (sources no two copies share: a pull's parts, each with its own bytes of the slot); one that quantizes
        (from a mapped arena into the parameters) saves what it writes and puts it back afterwards."""
        saved = []
        if restore and self.quantize:
            saved = [(t, t.clone()) for q in self.quantize for t in (q.weight, q.scale)]
            saved += [(c.dst, c.dst.clone()) for c in self.copies]
        for c in self.copies if restore and not saved else ():
            c.src.copy_(c.dst, non_blocking=True)
        for q in self.quantize:
            quantize_into(q.src, q.weight, q.scale, name=q.name)
        for c in self.copies:
            c.dst.copy_(c.src, non_blocking=True)
        if self.quantize:
            non_finite_blocks([q.scale for q in self.quantize])
        for dst, kept in reversed(saved):
            dst.copy_(kept, non_blocking=True)


def check_finite(programs: Sequence[Program]) -> None:
    """NonFiniteWeightError if a block some program quantized held inf or NaN: one host synchronization for all
    of them (none without quantizations)."""
    steps = [q for p in programs for q in p.quantize]
    if steps and (bad := int(non_finite_blocks([q.scale for q in steps]))):
        names = ", ".join(q.name for q in steps)
        raise NonFiniteWeightError(f"cannot quantize {names}: {bad} of their blocks hold inf or NaN")


class ProgramBuilder:
    """Collects quantizations and copies (one per cover or part), then batches them into a :class:`Program`."""

    def __init__(self) -> None:
        self._quant: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, str]] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._later: list[tuple[int, Callable[[torch.Tensor, torch.Tensor], None]]] = []

    def quantize(
        self,
        src: torch.Tensor,
        name: str,
        weight: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        then: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """Quantize the matrix ``src`` into ``weight``/``scale`` (both or neither: then into scratch, and
        ``then(weight, scale)`` is called with the scratch views once they exist, to add copies out of them)."""
        self._quant.append((src, weight, scale, name))
        if then is not None:
            self._later.append((len(self._quant) - 1, then))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies.append((dst, src))

    def build(self, persistent: bool) -> Program:
        scratch = self._scratch_steps()
        steps = [*self._direct_steps(), *scratch]
        runs = stacked_runs([c for c in self._copies if c[0].numel()])
        copies = [CopyStep(*as_words(dst, src)) for _, (dst, src) in runs]
        nbytes = sum(q.weight.nbytes + q.scale.nbytes for q in scratch)
        return Program(tuple(steps), tuple(copies), persistent, nbytes)

    def _direct_steps(self) -> list[QuantizeStep]:
        jobs = [(i, (s, w, c)) for i, (s, w, c, _) in enumerate(self._quant) if w is not None and c is not None]
        out = []
        for run, (src, w, s) in stacked_runs([j for _, j in jobs], _limit(jobs[0][1][0]) if jobs else None):
            out.append(QuantizeStep(src, w, s, _label([self._quant[jobs[k][0]][3] for k in run])))
        return out

    def _scratch_steps(self) -> list[QuantizeStep]:
        jobs = [i for i, (_, w, _, _) in enumerate(self._quant) if w is None]
        later = dict(self._later)
        out = []
        limit = _limit(self._quant[jobs[0]][0]) if jobs else None
        for run, (src,) in stacked_runs([(self._quant[i][0],) for i in jobs], limit):
            weight = torch.empty(src.shape, dtype=FP8_DTYPE, device=src.device)
            scale = torch.empty(scale_shape(src.shape), dtype=torch.float32, device=src.device)
            out.append(QuantizeStep(src, weight, scale, _label([self._quant[jobs[k]][3] for k in run])))
            for k, i in enumerate(run):
                if jobs[i] in later:
                    later[jobs[i]](weight[k], scale[k])
        return out


WORDS = (torch.int64, torch.int32, torch.int16)
"""Integer words a byte-exact copy may move its elements as, widest first."""


def as_words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` (one dtype: the copy moves bytes) as the widest integer words both views allow (rows,
    strides and offsets multiples of the word), else as they are. torch's copy of non-contiguous views moves one
    element per load: a strided copy of 1-byte FP8 weights as 8-byte words issues 8x fewer loads."""
    if dst.dtype != src.dtype or dst.shape != src.shape or not dst.dim():
        return dst, src
    for word in WORDS:
        if word.itemsize <= dst.element_size():
            break
        try:
            return dst.view(word), src.view(word)
        except RuntimeError:  # a row, stride or offset that is not a multiple of the word
            continue
    return dst, src


def _label(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} (and {len(names) - 1} more)"


def _limit(t: torch.Tensor) -> int | None:
    """Elements per quantization call: the torch path holds a float32 copy of its input; Triton needs no cap."""
    return None if default_backend(t) == "triton" else MAX_BATCH_ELEMENTS


class Streams:
    """One CUDA stream per key (a serve slot), so that programs of different slots overlap on the device; on CPU
    the same code runs with no stream."""

    def __init__(self) -> None:
        self._streams: dict[tuple[Hashable, torch.device], torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def on(self, buf: torch.Tensor, key: Hashable) -> Iterator[torch.cuda.Stream | None]:
        """Run the body on ``key``'s stream after what the current stream already queued (CPU: as it is)."""
        if not buf.is_cuda:
            yield None
            return
        with self._lock:
            stream = self._streams.get((key, buf.device))
            if stream is None:
                stream = self._streams[(key, buf.device)] = torch.cuda.Stream(buf.device)
        stream.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(stream):
            yield stream
