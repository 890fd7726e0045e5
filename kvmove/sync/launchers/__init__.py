"""Launchers (a registry): how the ranks of a run are started and reached. ``ray`` (Ray actors, the default)
and ``processes`` (plain local processes, no Ray) run the same rank hosts; see ``base`` for the interface."""

from __future__ import annotations

from kvmove.errors import KvmoveError
from kvmove.sync.launchers.base import Launcher
from kvmove.sync.launchers.processes import ProcessLauncher
from kvmove.sync.launchers.ray import RayLauncher

LAUNCHERS: dict[str, type[Launcher]] = {"ray": RayLauncher, "processes": ProcessLauncher}


def get_launcher(name: str) -> type[Launcher]:
    try:
        return LAUNCHERS[name]
    except KeyError:
        raise KvmoveError(f"unknown launcher {name!r} (known: {', '.join(LAUNCHERS)})") from None
