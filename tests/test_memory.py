"""kvmove.memory: the kernel's available memory, and the physical memory where it does not say."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmove import memory


def test_available_memory_is_the_kernels_and_within_physical() -> None:
    available = memory.available_memory()
    assert available is not None and 0 < available <= memory.physical_memory()
    assert memory.usable_memory() == available


def test_without_meminfo_usable_memory_is_the_physical(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(_self: Path) -> str:
        raise OSError("no /proc here")

    monkeypatch.setattr(Path, "read_text", unreadable)
    assert memory.available_memory() is None
    assert memory.usable_memory() == memory.physical_memory()


def test_the_sync_checks_and_the_server_probe_memory_through_it() -> None:
    from kvmove.server import resources
    from kvmove.sync.driver import checks

    assert resources.available_memory is memory.available_memory and checks.usable_memory is memory.usable_memory
