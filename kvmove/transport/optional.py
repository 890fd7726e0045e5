"""Optional dependencies of transports (Ray, NIXL): imported on use, refused in one line naming the extra."""

from __future__ import annotations

import importlib
from typing import Any

from kvmove.errors import MissingDependencyError


def import_optional(module: str, extra: str, what: str) -> Any:
    """Import ``module`` or raise MissingDependencyError naming the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = f"pip install 'kvmove[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise MissingDependencyError(f"{what} needs {module!r}, which is not installed: {hint}") from exc


def can_import(module: str) -> bool:
    """Whether ``module`` imports here; never raises."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True
