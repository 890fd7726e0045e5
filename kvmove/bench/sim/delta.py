"""Delta syncs priced: the changed fraction per region class as a parameter, the bytes from the encoding's owner.

A delta sync (``kvmove sync-weights --delta``, ``docs/delta-sync.md``) packs every packed pull densely as usual,
compares it with the image the trainer last served (a device-memory pass over the payload), sends the smallest
encoding of the changed words, and the engine applies it through the pull's landing program (one more pass over
the pull's bytes). So the traffic of a delta sync is the dense traffic with, per engine rank and group:

- the wire bytes of its pulls from :func:`kvmove.sync.delta.encoding.delta_bytes` (the rule's owner: the smallest
  encoding, never more than dense) at the changed fraction of the words those pulls carry, the fraction weighted
  over the region classes of ``kvmove.sync.delta.detect.region_class`` that make up the pulls;
- a detection pass over every byte the trainer packs (``detect``), paid whatever encoding wins;
- an apply pass over the bytes of every pull that went as a delta (``apply``), none for pulls that went dense.

Which pulls can go as a delta is the sync's rule: packed pulls only (direct reads are planned packed under
``--delta``), never a broadcast, never pulls the engine quantizes itself. The rates of the two passes are costs
(``delta_detect_efficiency``, ``delta_apply_efficiency``) set by the delta suite's rows
(``kvmove bench run --suite delta``) through setup matching; the fractions are a setup parameter
(``--delta-fraction``: one number, per class, or ``measured``: the newest delta rows' medians).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvmove.errors import KvmoveError
from kvmove.sync.delta.detect import REGION_CLASSES

if TYPE_CHECKING:
    import pandas as pd

    from kvmove.bench.sim.setup import SimSetup
    from kvmove.bench.sim.traffic import Traffic

WORD_BYTES = 2
"""Payloads are compared as int16 words (``kvmove.sync.delta.encoding.payload_words``)."""


@dataclasses.dataclass(frozen=True)
class DeltaFractions:
    """Changed fraction of the words of each region class (``default`` for classes not named)."""

    default: float
    classes: tuple[tuple[str, float], ...] = ()

    def of(self, region_class: str) -> float:
        return dict(self.classes).get(region_class, self.default)

    def text(self) -> str:
        """The ``--delta-fraction`` text that rebuilds it."""
        return ",".join([f"default={self.default:.3g}", *(f"{c}={f:.3g}" for c, f in self.classes)])


def parse_fractions(text: str) -> DeltaFractions:
    """``0.02`` (every class) or ``attention=0.02,experts=0.03[,default=0.02]``; fractions in [0, 1]."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if len(parts) == 1 and "=" not in parts[0]:
        return DeltaFractions(_fraction(text, parts[0]))
    named: dict[str, float] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in (*REGION_CLASSES, "default"):
            raise KvmoveError(
                f"--delta-fraction {text!r}: {part!r} is not CLASS=FRACTION (classes: "
                f"{', '.join(REGION_CLASSES)}, default), a single fraction, or 'measured'"
            )
        named[key] = _fraction(text, raw)
    if not named:
        raise KvmoveError(f"--delta-fraction {text!r} names no fraction")
    default = named.pop("default", max(named.values()))
    return DeltaFractions(default, tuple(sorted(named.items())))


def _fraction(text: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise KvmoveError(f"--delta-fraction {text!r}: {raw.strip()!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise KvmoveError(f"--delta-fraction {text!r}: a changed fraction lies in [0, 1], got {value:g}")
    return value


class Measured(NamedTuple):
    """Changed fractions measured by the delta suite: per class, the median over the newest commit's rows."""

    fractions: DeltaFractions
    commit: str
    rows: int


def measured_fractions(rows: pd.DataFrame | None) -> Measured:
    """The newest delta rows' changed fractions (a KvmoveError when there are none): the optimizer step's
    property, whatever device measured it."""
    df = _delta_rows(rows)
    if df is None or df.empty:
        raise KvmoveError("--delta-fraction measured: no delta rows under --results (kvmove bench run --suite delta)")
    commit = str(df["git_commit"].iloc[-1])
    extras = [e for e, c in zip(df["extra_d"], df["git_commit"], strict=True) if c == commit]
    per: dict[str, list[float]] = {}
    for e in extras:
        for cls, frac in (e.get("changed_fraction") or {}).items():
            if cls in REGION_CLASSES:
                per.setdefault(cls, []).append(float(frac))
    alls = [float(e["changed_fraction_all"]) for e in extras if "changed_fraction_all" in e]
    default = statistics.median(alls) if alls else statistics.median(v for vs in per.values() for v in vs)
    classes = tuple(sorted((c, statistics.median(v)) for c, v in per.items()))
    return Measured(parse_fractions(DeltaFractions(default, classes).text()), commit, len(extras))


def _delta_rows(rows: pd.DataFrame | None) -> pd.DataFrame | None:
    if rows is None or rows.empty:
        return None
    from kvmove.bench.sim.samples import decorated

    df = decorated(rows)
    return df[df["suite"] == "delta"]


def deltable(s: SimSetup, broadcast: bool) -> bool:
    """Whether the sync's rule lets any pull of this strategy go as a delta."""
    return s.delta is not None and not broadcast and not (s.dtype == "fp8" and s.quantize_on == "engine")


def apply_delta(t: Traffic, s: SimSetup) -> Traffic:
    """The dense traffic ``t`` of a packed strategy as a delta sync at ``s.delta``'s fractions (see the module
    docstring); ``t`` itself for a dense sync or a strategy that cannot send deltas."""
    if s.delta is None or not deltable(s, t.strategy.broadcast):
        return t
    e, tr = dict(t.e), dict(t.t)
    dense = e["recv"]
    changed = np.sum([e[f"recv.{c}"] * s.delta.of(c) for c in REGION_CLASSES], axis=0)
    coded, went = _coded(dense, changed, np.maximum(e["pulls"], 1.0))
    e["scatter"] = np.where(changed > 0, e["scatter"], 0.0)  # a pull with nothing changed is neither read nor landed
    ratio = np.divide(coded.sum(axis=1), dense.sum(axis=1), out=np.ones(len(dense)), where=dense.sum(axis=1) > 0)
    e["recv"], e["kept"] = coded, np.where(dense > 0, e["kept"] * coded / np.maximum(dense, 1.0), e["kept"])
    e["apply"] = np.where(went, dense, 0.0)
    tr["send"], tr["detect"] = tr["send"] * ratio[:, None], tr["send"].copy()  # every packed byte is compared
    return dataclasses.replace(t, e=e, t=tr, max_request=t.max_request * ratio)


def _coded(dense: np.ndarray, changed: np.ndarray, pulls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (group, engine rank): wire bytes of its pulls as deltas (``changed`` of their ``dense`` bytes changed,
    spread evenly over its ``pulls``), and whether they went as deltas that change something."""
    from kvmove.sync.delta.encoding import delta_bytes

    coded = np.zeros_like(dense)
    for (g, k), nbytes in np.ndenumerate(dense):
        if nbytes <= 0:
            continue
        each = round(float(nbytes / pulls[g, k]) / WORD_BYTES) * WORD_BYTES
        frac = min(1.0, float(changed[g, k] / nbytes))
        coded[g, k] = min(nbytes, delta_bytes(each, frac, WORD_BYTES) * pulls[g, k])
    return coded, (coded < dense) & (changed > 0)
