"""The trainer's side of a delta sync: the image each engine rank was last served, per pull, and the choice,
per pull, between packing it densely and writing only what changed since into the serve slot.

An image is kept per (strategy, engine rank, pull) with the sync it was taken in. A pull is encoded against it
only when the driver vouches that the engine rank holds that sync's weights (``TrainerSync.delta`` maps each
engine rank to the last sync it completed); otherwise - a first sync, an engine rank that rejoined or missed a
sync, a full sync, a pull the engine quantizes itself (it lands BF16 pieces it does not keep) - the pull is
packed densely and its image refreshed from the slot. Images live on the trainer rank's device and count toward
its extra memory.

A delta is found straight from the pull's sources (:mod:`kvmove.sync.delta.diff`): the dense payload is never
written. Where more words changed than an encoding carries in fewer bytes than dense, the comparison stops
early and the pull goes dense; it then skips the comparison for its next syncs (1, 2, 4, then every 8, while
that holds), packing densely at the cost of a dense sync, and refreshing its image only in the sync before the
next comparison.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvmove.models.tensors import expert_of
from kvmove.sync.delta.diff import diff, program_steps, slot_steps
from kvmove.sync.delta.encoding import Encoding, Words, choose, longest_gap, most_changed, payload_words, write
from kvmove.sync.planning.entries import ENGINE
from kvmove.sync.planning.packing import ServeSpec
from kvmove.sync.programs import Program

REGION_CLASSES = ("attention", "dense_mlp", "experts", "embeddings", "other")
MAX_WAIT = 8
"""The most syncs a pull that keeps going dense by size waits between two comparisons."""


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
class _Kept:
    sync_id: int
    """The sync whose payload the image holds (-1: none an engine holds: it was not refreshed)."""
    image: torch.Tensor
    wait: int = 0
    """Syncs left before the pull is compared again (it went dense by size)."""
    dense_runs: int = 0
    """Comparisons in a row that found more changed than an encoding carries."""


class Images:
    """One trainer rank's kept images and the delta counters of the sync in progress (thread-safe per key:
    each (strategy, engine, pull) is packed by one thread at a time)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int, int], _Kept] = {}
        self._words: dict[tuple[str, int, int], PullWords] = {}
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
        rank knows of): the delta against its image where one is smaller, else the dense payload ``program``
        packs. The image then holds this sync's payload (or, while the pull skips comparisons, none)."""
        pw = self._words.get(key)
        if pw is None:
            pw = self._words[key] = pull_words(specs, buf.device)
        self._add("dense_bytes", pw.words.dense_bytes)
        kept = self._kept.get(key)
        if not pw.deltable:
            program.run()
            return self._dense(pw.words)
        if kept is None or base is None or kept.sync_id != base or kept.wait:
            program.run()
            self._refresh(key, kept, sync_id, buf, pw.words)
            return self._dense(pw.words)
        steps = program_steps(program, buf, pw.words)
        if steps is None:  # nothing to compare but the packed payload
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

    def _dense(self, words: Words) -> Coded:
        self._add("pulls.dense", 1)
        self._add("sent_bytes", words.dense_bytes)
        return Coded(words.dense_bytes, Encoding.DENSE, 0)

    def _refresh(
        self, key: tuple[str, int, int], kept: _Kept | None, sync_id: int, buf: torch.Tensor, words: Words
    ) -> None:
        """After a dense pack: the image takes the payload, unless the pull skips comparisons for more than the
        next sync (then the copy would be wasted: the image is marked as held by no engine)."""
        payload = buf[: words.dense_bytes]
        if kept is None or kept.image.shape != payload.shape:
            self._kept[key] = _Kept(sync_id, payload.clone())
            return
        if kept.wait > 1:
            kept.sync_id = -1
        else:
            kept.image.copy_(payload)
            kept.sync_id = sync_id
        kept.wait = max(kept.wait - 1, 0)

    def _count_classes(self, pw: PullWords, positions: torch.Tensor) -> None:
        ends = torch.searchsorted(positions, pw.bounds).tolist()  # positions are ascending
        for i, (cls, span) in enumerate(zip(pw.classes, pw.words.parts, strict=True)):
            self._add(f"changed.{cls}", ends[i + 1] - ends[i])
            self._add(f"words.{cls}", span.words)


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
        "changed_fraction": fractions,
        "changed_fraction_all": changed / compared if compared else None,
    }
