"""The trainer's side of a delta sync: the image each engine rank was last served, per pull, and the choice,
per pull, between packing it densely and writing only what changed since into the serve slot.

An image is kept per (strategy, engine rank, pull) with the sync it was taken in. A pull is encoded against it
only when the driver vouches that the engine rank holds that sync's weights (``TrainerSync.delta`` maps each
engine rank to the last sync it completed); otherwise - a first sync, an engine rank that rejoined or missed a
sync, a full sync, a pull the engine quantizes itself (it lands BF16 pieces it does not keep) - the pull is
packed densely and its image refreshed from the slot. Images live on the trainer rank's device and count toward
its extra memory.

A delta is found by :mod:`kvmove.sync.delta.diff` (on a GPU straight from the pull's sources; on a CPU from the
packed slot). Where more words changed than an encoding carries in fewer bytes than dense, nothing is gathered
and the pull goes dense; it then skips the comparison for its next syncs (1, 2, 4, then every 8, while that
holds), packing densely at the cost of a dense sync, and refreshing its image only in the sync before the next
comparison. The same holds **by cost**: each pull's last dense and last delta serve are timed, with the engine's
read of each (:meth:`Images.note_read`), and where the delta cost more, trainer and link together, the pull goes
dense up front for 1, 2, 4, ... up to 32 syncs, then is compared (and timed) again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvmove.models.tensors import expert_of
from kvmove.sync.delta.diff import Steps, diff, finder, program_steps, slot_steps
from kvmove.sync.delta.encoding import Encoding, Words, choose, longest_gap, most_changed, payload_words, write
from kvmove.sync.planning.entries import ENGINE
from kvmove.sync.planning.packing import ServeSpec
from kvmove.sync.programs import Program

REGION_CLASSES = ("attention", "dense_mlp", "experts", "embeddings", "other")
MAX_WAIT = 8
"""The most syncs a pull that keeps going dense by size waits between two comparisons."""
COST_WAIT = 32
"""The most syncs a pull whose deltas keep costing more than its dense syncs waits between two comparisons (one
delta in 33 syncs that costs twice a dense one adds 3% over dense, in the steady state)."""


def region_class(tensor: str) -> str:
    """The class of an HF (or megatron-core) tensor a changed fraction is reported under."""
    if expert_of(tensor) is not None or ".experts." in tensor:
        return "experts"
    if "embed" in tensor or "lm_head" in tensor or "output_layer" in tensor:
        return "embeddings"
    if "attn" in tensor or "attention" in tensor:
        return "attention"
    if ".mlp." in tensor and not tensor.endswith("mlp.gate.weight") and "router" not in tensor:
        return "dense_mlp"
    return "other"


class PullWords(NamedTuple):
    """What the trainer knows of one pull's payload: its words, the class of each part and what bounds a delta."""

    words: Words
    classes: tuple[str, ...]
    """The region class of each part with bytes (``words.parts``)."""
    bounds: torch.Tensor
    """Each part's first position, then the payload's end (int64, on the slot's device): changes per part."""
    limit: int
    """The most changed words an encoding carries in fewer bytes than dense."""
    deltable: bool
    """False where the engine stages a part (the ``engine`` transform): such pulls always go dense."""


def pull_words(specs: Sequence[ServeSpec], device: torch.device) -> PullWords:
    sizes = [n for s in specs for n in s.sizes]
    words = payload_words(sizes)
    classes = tuple(region_class(s.tensor) for s in specs for n in s.sizes if n)
    bounds = torch.tensor([*(p.start for p in words.parts), words.words], dtype=torch.int64, device=device)
    deltable = all(s.transform != ENGINE for s in specs)
    return PullWords(words, classes, bounds, most_changed(words), deltable)


class Coded(NamedTuple):
    """How a packed pull goes out: its bytes in the slot, its encoding and how many words changed."""

    nbytes: int
    encoding: Encoding
    changed: int


@dataclass
class Costs:
    """What one pull's last dense and last delta serve cost, measured: the trainer's seconds (a dense pack; a
    delta's comparison and encoding, with the pack where it packs first) and the engine's read of the slot
    (noted by :meth:`Images.note_read` once the engine has read it)."""

    pack_s: float | None = None
    delta_s: float | None = None
    dense_read_s: float | None = None
    delta_read_s: float | None = None
    last: str = ""
    """What the slot last served holds, for the read noted next: "dense", "delta", or "" (nothing to note)."""

    def served(self, kind: str, seconds: float | None) -> None:
        """The pull was served ``kind`` ("dense" or "delta") in ``seconds`` (None: not a measure of that kind)."""
        if seconds is not None:
            if kind == "dense":
                self.pack_s = seconds
            else:
                self.delta_s = seconds
        self.last = kind

    def read(self, seconds: float) -> None:
        if self.last == "dense":
            self.dense_read_s = seconds
        elif self.last == "delta":
            self.delta_read_s = seconds
        self.last = ""

    def verdict(self) -> bool | None:
        """Whether the last delta measured cost more, trainer and link, than the last dense serve (None: not
        both known). Each delta is judged once: the next is measured anew (load and link change)."""
        known = (self.pack_s, self.delta_s, self.dense_read_s, self.delta_read_s)
        if any(x is None for x in known):
            return None
        pack, delta, dense_read, delta_read = (float(x or 0.0) for x in known)
        self.delta_s = self.delta_read_s = None
        return delta + delta_read > pack + dense_read


@dataclass
class _Kept:
    sync_id: int
    """The sync whose payload the image holds (-1: none an engine holds: it was not refreshed)."""
    image: torch.Tensor
    wait: int = 0
    """Syncs left before the pull is compared again (it went dense by size)."""
    dense_runs: int = 0
    """Comparisons in a row that found more changed than an encoding carries."""
    costly_runs: int = 0
    """Deltas in a row that cost more than dense."""
    costs: Costs = field(default_factory=Costs)

    def judge(self) -> bool:
        """The verdict on the last delta, by cost: True where it cost more than dense, and the pull then goes
        dense up front for 1, 2, 4, ... (at most :data:`COST_WAIT`) syncs."""
        verdict = self.costs.verdict()
        if verdict is None:
            return False
        self.costly_runs = self.costly_runs + 1 if verdict else 0
        if verdict:
            self.wait = min(2 ** (self.costly_runs - 1), COST_WAIT)
        return verdict


class Images:
    """One trainer rank's kept images and the delta counters of the sync in progress (thread-safe per key:
    each (strategy, engine, pull) is packed by one thread at a time)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int, int], _Kept] = {}
        self._words: dict[tuple[str, int, int], PullWords] = {}
        self._steps: dict[tuple[str, int, int], tuple[Program, int, Steps | None]] = {}
        """Per pull, its pack program's steps (a pull's program and slot are built once and replayed)."""
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()  # pulls of different engine ranks are packed on their own threads

    @property
    def nbytes(self) -> int:
        return sum(k.image.numel() * k.image.element_size() for k in list(self._kept.values()))

    def forget(self, engine: int) -> None:
        """Drop what is kept for engine rank ``engine`` (it left: it registers its pulls again if it rejoins)."""
        for key in [k for k in self._kept if k[1] == engine]:
            del self._kept[key]
        for key in [k for k in self._words if k[1] == engine]:
            del self._words[key]
        for key in [k for k in self._steps if k[1] == engine]:
            del self._steps[key]

    def take_counts(self) -> dict[str, int]:
        with self._lock:
            out, self.counts = self.counts, {}
        return out

    def _add(self, key: str, n: int) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def serve(
        self,
        key: tuple[str, int, int],
        program: Program,
        buf: torch.Tensor,
        specs: Sequence[ServeSpec],
        sync_id: int,
        base: int | None,
    ) -> Coded:
        """Serve pull ``key`` into ``buf`` for an engine rank holding the payload of sync ``base`` (None: none this
        rank knows of): the delta against its image where one is smaller and, by the last delta's measured
        cost, faster; else the dense payload ``program`` packs. The image then holds this sync's payload (or,
        while the pull skips comparisons, none)."""
        pw = self._words.get(key)
        if pw is None:
            pw = self._words[key] = pull_words(specs, buf.device)
        self._add("dense_bytes", pw.words.dense_bytes)
        kept = self._kept.get(key)
        if not pw.deltable:
            program.run()
            return self._dense(pw.words)
        vouched = kept is not None and base is not None and kept.sync_id == base
        if vouched and kept is not None and not kept.wait and kept.judge():  # by cost: dense, then measured again
            self._add("pulls.dense_by_cost", 1)
        if kept is None or not vouched or kept.wait:
            t0 = _now(buf)
            program.run()
            packed = _now(buf) - t0
            kept = self._refresh(key, kept, sync_id, buf, pw.words)
            kept.costs.served("dense", packed)
            return self._dense(pw.words)
        t0 = _now(buf)
        coded = self._delta(key, kept, program, buf, pw, sync_id)
        if coded.encoding is Encoding.DENSE:  # by size: compared, then packed (not a dense pack's cost)
            kept.costs.served("dense", None)
        else:
            kept.costs.served("delta", _now(buf) - t0)
        return coded

    def _delta(
        self, key: tuple[str, int, int], kept: _Kept, program: Program, buf: torch.Tensor, pw: PullWords, sync_id: int
    ) -> Coded:
        """Serve a pull whose engine rank holds the image's payload: the delta, or dense where it is no smaller."""
        steps = None if finder(buf.device).packs_first else self._program_steps(key, program, buf, pw.words)
        if steps is None:  # compare the packed payload
            program.run()
            steps = slot_steps(buf, pw.words)
        changes = diff(steps, kept.image, pw.words, pw.limit)
        kept.sync_id = sync_id
        if changes is None:  # more changed than an encoding carries: pack, and the image takes the payload
            if not steps.packed:
                program.run()
            kept.image.copy_(buf[: pw.words.dense_bytes])
            kept.dense_runs += 1
            kept.wait = min(2 ** (kept.dense_runs - 1), MAX_WAIT)
            self._add("pulls.dense_by_size", 1)
            return self._dense(pw.words)
        kept.dense_runs = 0
        changed = changes.positions.numel()
        self._count_classes(pw, changes.positions)
        encoding = choose(pw.words, changed, longest_gap(changes.positions))
        nbytes = write(buf, pw.words, encoding, changes.positions, changes.values)
        self._add(f"pulls.{encoding}", 1)
        self._add("sent_bytes", nbytes)
        return Coded(nbytes, encoding, changed)

    def _program_steps(
        self, key: tuple[str, int, int], program: Program, buf: torch.Tensor, words: Words
    ) -> Steps | None:
        """``program``'s steps into ``buf``, found once per pull (the program object and slot address vouch for
        them: a pull rebuilt with another program or slot is found again)."""
        found = self._steps.get(key)
        if found is None or found[0] is not program or found[1] != buf.data_ptr():
            found = self._steps[key] = (program, buf.data_ptr(), program_steps(program, buf, words))
        return found[2]

    def note_read(self, key: tuple[str, int, int], seconds: float) -> None:
        """The engine rank read what pull ``key`` was last served as in ``seconds``: the link's side of its
        cost, which decides whether its deltas pay (:class:`Costs`)."""
        kept = self._kept.get(key)
        if kept is not None:
            kept.costs.read(seconds)

    def _dense(self, words: Words) -> Coded:
        self._add("pulls.dense", 1)
        self._add("sent_bytes", words.dense_bytes)
        return Coded(words.dense_bytes, Encoding.DENSE, 0)

    def _refresh(
        self, key: tuple[str, int, int], kept: _Kept | None, sync_id: int, buf: torch.Tensor, words: Words
    ) -> _Kept:
        """After a dense pack: the image takes the payload, unless the pull skips comparisons for more than the
        next sync (then the copy would be wasted: the image is marked as held by no engine)."""
        payload = buf[: words.dense_bytes]
        if kept is None or kept.image.shape != payload.shape:
            kept = self._kept[key] = _Kept(sync_id, payload.clone())
            return kept
        if kept.wait > 1:
            kept.sync_id = -1
        else:
            kept.image.copy_(payload)
            kept.sync_id = sync_id
        kept.wait = max(kept.wait - 1, 0)
        return kept

    def _count_classes(self, pw: PullWords, positions: torch.Tensor) -> None:
        ends = torch.searchsorted(positions, pw.bounds).tolist()  # positions are ascending
        for i, (cls, span) in enumerate(zip(pw.classes, pw.words.parts, strict=True)):
            self._add(f"changed.{cls}", ends[i + 1] - ends[i])
            self._add(f"words.{cls}", span.words)


def _now(buf: torch.Tensor) -> float:
    """The clock, once ``buf``'s device has run what was queued on it (a GPU's work is timed, not its launch)."""
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()
    return time.perf_counter()


def summary(counts: Sequence[dict[str, int]]) -> dict[str, Any]:
    """One sync's delta figures from every trainer rank's counters (empty when none ran a delta sync)."""
    total: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            total[k] = total.get(k, 0) + n
    if not total:
        return {}
    dense, sent = total.get("dense_bytes", 0), total.get("sent_bytes", 0)
    fractions = {
        cls: total.get(f"changed.{cls}", 0) / total[f"words.{cls}"]
        for cls in REGION_CLASSES
        if total.get(f"words.{cls}")
    }
    compared = sum(total.get(f"words.{cls}", 0) for cls in REGION_CLASSES)
    changed = sum(total.get(f"changed.{cls}", 0) for cls in REGION_CLASSES)
    return {
        "dense_bytes": dense,
        "sent_bytes": sent,
        "ratio": sent / dense if dense else 1.0,
        "pulls": {str(e): total.get(f"pulls.{e}", 0) for e in Encoding},
        "dense_by_size": total.get("pulls.dense_by_size", 0),
        "dense_by_cost": total.get("pulls.dense_by_cost", 0),
        "changed_fraction": fractions,
        "changed_fraction_all": changed / compared if compared else None,
    }
