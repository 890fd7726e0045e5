"""Fixtures of the rank tests."""

from __future__ import annotations

import pytest

from kvmove.sync.programs import Program


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Ids of the programs run by a warm-up (``warm``) and by a sync (``run``), in order."""
    seen: dict[str, list[int]] = {"warm": [], "run": []}
    real_run, real_warm = Program.run, Program.warm

    def run(self: Program, check: bool = True) -> None:
        seen["run"].append(id(self))
        real_run(self, check)

    def warm(self: Program, restore: bool = False) -> None:
        seen["warm"].append(id(self))
        real_warm(self, restore)

    monkeypatch.setattr(Program, "run", run)
    monkeypatch.setattr(Program, "warm", warm)
    return seen
