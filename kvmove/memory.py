"""This machine's memory, as the kernel reports it: the one owner of memory probing.

The sync's up-front checks (kvmove.sync.driver.checks) refuse CPU runs whose ranks would not fit, and ``kvmove
serve`` (kvmove.server.resources) refuses KV pools larger than what is available, both from these numbers.
"""

from __future__ import annotations

import os
from pathlib import Path


def available_memory() -> int | None:
    """Bytes the kernel reports as available to new allocations (``MemAvailable``), or None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def physical_memory() -> int:
    """Bytes of physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usable_memory() -> int:
    """What new allocations may use: the available memory where the kernel says, else the physical memory."""
    available = available_memory()
    return available if available is not None else physical_memory()
