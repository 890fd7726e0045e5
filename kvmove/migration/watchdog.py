"""The watchdog: rolls back migrations that were allocated but not committed within the timeout.

``tick`` is called from the worker's step loop; it runs ``MigrationTarget.expire`` at most once per ``interval_s``,
so an abandoned migration is released between ``timeout`` and ``timeout + interval`` after its allocation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmove.migration.target import MigrationTarget


class Watchdog:
    def __init__(
        self, target: MigrationTarget, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.target, self.interval_s, self.clock = target, interval_s, clock
        self.expired: list[str] = []
        self._last = clock()

    def tick(self) -> list[str]:
        """Expire overdue migrations if ``interval_s`` passed since the last check; returns the ids released."""
        now = self.clock()
        if now - self._last < self.interval_s:
            return []
        self._last = now
        released = self.target.expire()
        self.expired.extend(released)
        return released
