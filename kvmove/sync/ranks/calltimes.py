"""Timed calls of one kind (a broadcast root's sends), kept as the sums a least-squares line needs.

A call of ``b`` bytes takes ``fixed + b * per_byte`` seconds; a sync's calls span sizes (a norm's few hundred bytes,
an embedding's megabytes), so one sync's calls tell the two terms apart, where its total alone cannot. Five sums
travel with a rank's stats instead of one entry per call.
"""

from __future__ import annotations

from typing import NamedTuple

MIN_CALLS = 8
"""Fewer calls than this fit no line (a sync of a handful of tensors says little about either term)."""


class Line(NamedTuple):
    """Seconds of a call of ``b`` bytes: ``fixed + b * per_byte``."""

    fixed: float
    per_byte: float


class CallTimes(NamedTuple):
    """Sums over timed calls: how many, their bytes, seconds, bytes squared and bytes x seconds."""

    calls: int = 0
    bytes: float = 0.0
    seconds: float = 0.0
    bytes_sq: float = 0.0
    bytes_seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> CallTimes:
        """These sums with one more call of ``nbytes`` that took ``seconds``."""
        b = float(nbytes)
        return CallTimes(
            self.calls + 1,
            self.bytes + b,
            self.seconds + seconds,
            self.bytes_sq + b * b,
            self.bytes_seconds + b * seconds,
        )

    def fit(self) -> Line | None:
        """The least-squares line through the calls, or None where they cannot give one: fewer than
        :data:`MIN_CALLS`, all of one size, or a line without a positive fixed and per-byte term (time that falls
        with size, or calls slower than their bytes account for only at zero bytes, is noise, not a rate)."""
        n = self.calls
        if n < MIN_CALLS:
            return None
        spread = n * self.bytes_sq - self.bytes**2
        if spread <= 1e-9 * n * self.bytes_sq:
            return None
        per_byte = (n * self.bytes_seconds - self.bytes * self.seconds) / spread
        fixed = (self.seconds - per_byte * self.bytes) / n
        return Line(fixed, per_byte) if fixed > 0 and per_byte > 0 else None

    def as_json(self) -> dict[str, float]:
        return self._asdict()
