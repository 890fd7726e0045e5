"""The trainer's side of a delta sync: the image each engine rank was last served, per pull, and the detection
and encoding of what changed since, written over the dense payload in the serve slot.

An image is kept per (strategy, engine rank, pull) with the sync it was taken in. A pull is encoded against it
only when the driver vouches that the engine rank holds that sync's weights (``TrainerSync.delta`` maps each
engine rank to the last sync it completed); otherwise - a first sync, an engine rank that rejoined or missed a
sync, a full sync, a pull the engine quantizes itself (it lands BF16 pieces it does not keep) - the pull goes
dense and its image is refreshed. Images live on the trainer rank's device and count toward its extra memory.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvmove.models.tensors import expert_of
from kvmove.sync.delta.encoding import Encoding, Words, choose, live, payload_words, write
from kvmove.sync.planning.entries import ENGINE
from kvmove.sync.planning.packing import ServeSpec

REGION_CLASSES = ("attention", "dense_mlp", "experts", "embeddings", "other")


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
    """What the trainer knows of one pull's payload: its live words and the class of each part's words."""

    words: Words
    ends: torch.Tensor
    """Cumulative live words at the end of each part (int64, on the slot's device)."""
    classes: tuple[str, ...]
    deltable: bool
    """False where the engine stages a part (the ``engine`` transform): such pulls always go dense."""


def pull_words(specs: Sequence[ServeSpec], device: torch.device) -> PullWords:
    sizes = [n for s in specs for n in s.sizes]
    words = payload_words(sizes)
    ends, at, classes = [], 0, []
    for spec in specs:
        for n in spec.sizes:
            at += n // words.word_bytes
            ends.append(at)
            classes.append(region_class(spec.tensor))
    deltable = all(s.transform != ENGINE for s in specs)
    return PullWords(words, torch.tensor(ends, dtype=torch.int64, device=device), tuple(classes), deltable)


class Coded(NamedTuple):
    """How a packed pull goes out: its bytes in the slot, its encoding and how many words changed."""

    nbytes: int
    encoding: Encoding
    changed: int


class _Kept(NamedTuple):
    sync_id: int
    image: torch.Tensor


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
        return sum(k.image.numel() * k.image.element_size() for k in self._kept.values())

    def forget(self, engine: int) -> None:
        for key in [k for k in self._kept if k[1] == engine]:
            del self._kept[key]

    def take_counts(self) -> dict[str, int]:
        with self._lock:
            out, self.counts = self.counts, {}
        return out

    def _add(self, key: str, n: int) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def encode(
        self, key: tuple[str, int, int], buf: torch.Tensor, specs: Sequence[ServeSpec], sync_id: int, base: int | None
    ) -> Coded:
        """Encode the dense payload packed in ``buf`` for pull ``key`` against the image taken in sync ``base``
        (None: the engine holds no image this rank knows of) and keep the payload as the new image."""
        pw = self._words.get(key)
        if pw is None:
            pw = self._words[key] = pull_words(specs, buf.device)
        words = pw.words
        self._add("dense_bytes", words.dense_bytes)
        kept = self._kept.get(key)
        if not pw.deltable:
            return self._dense(words)
        cur = live(buf, words)
        if kept is None or base is None or kept.sync_id != base:
            self._keep(key, sync_id, cur, kept)
            return self._dense(words)
        mask = cur != kept.image  # integer words: bits, so NaN, -0.0 and +0.0 compare exactly
        index = mask.nonzero().flatten()
        changed = index.numel()
        self._count_classes(pw, index)
        encoding = choose(words, changed)
        if encoding is Encoding.DENSE:
            kept.image.copy_(cur)
            self._kept[key] = _Kept(sync_id, kept.image)
            return self._dense(words)
        values = cur[index]  # a copy: taken before the slot is overwritten, ``cur`` may be a view of it
        kept.image[index] = values  # the rest of the image is the payload already
        self._kept[key] = _Kept(sync_id, kept.image)
        nbytes = write(buf, words, encoding, mask, index, values)
        self._add(f"pulls.{encoding}", 1)
        self._add("sent_bytes", nbytes)
        return Coded(nbytes, encoding, changed)

    def _dense(self, words: Words) -> Coded:
        self._add("pulls.dense", 1)
        self._add("sent_bytes", words.dense_bytes)
        return Coded(words.dense_bytes, Encoding.DENSE, 0)

    def _keep(self, key: tuple[str, int, int], sync_id: int, cur: torch.Tensor, kept: _Kept | None) -> None:
        if kept is not None and kept.image.shape == cur.shape:
            kept.image.copy_(cur)
            self._kept[key] = _Kept(sync_id, kept.image)
        else:
            self._kept[key] = _Kept(sync_id, cur.clone())

    def _count_classes(self, pw: PullWords, index: torch.Tensor) -> None:
        part = torch.searchsorted(pw.ends, index, right=True)
        changed = torch.bincount(part, minlength=len(pw.classes)).tolist()
        start = 0
        for end, cls, n in zip(pw.ends.tolist(), pw.classes, changed, strict=True):
            self._add(f"changed.{cls}", n)
            self._add(f"words.{cls}", end - start)
            start = end


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
        "changed_fraction": fractions,
        "changed_fraction_all": changed / compared if compared else None,
    }
