"""The step log of a server's worker: when each step of the decode loop ended, how long it took, what it ran.

What the decode-latency benchmark and the stall tests read (a bounded window, newest last); appending is one lock.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple


class StepRecord(NamedTuple):
    """One step: ended at ``at`` (``time.perf_counter``), ran ``seconds``, with ``decode`` requests decoding and
    ``prefill_tokens`` prompt tokens computed."""

    at: float
    seconds: float
    decode: int
    prefill_tokens: int


class StepLog:
    def __init__(self, maxlen: int = 100_000) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def record(self, step: StepRecord) -> None:
        with self._lock:
            self._steps.append(step)

    def between(self, start: float, stop: float = float("inf")) -> list[StepRecord]:
        """Steps that ended within ``[start, stop]``, oldest first."""
        with self._lock:
            return [s for s in self._steps if start <= s.at <= stop]
