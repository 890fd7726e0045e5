"""Changed fractions of a delta sync per region class: the ``--delta-fraction`` parameter of the simulator, parsed,
or measured by the delta suite (``kvmove bench run --suite delta``). Priced by ``kvmove.bench.sim.delta``."""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.sync.delta.detect import REGION_CLASSES

if TYPE_CHECKING:
    import pandas as pd

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
