"""Point-to-point byte movers behind one interface (``base.Transport``), registered by name: the one owner of what a
transport is called and of what ``auto`` means.

- Weight syncs (``kvmove sync-weights --transport``): ``SYNC_TRANSPORTS``; ``auto`` is the first available of
  ``AUTO_ORDER`` (without Ray actors, of those that need none).
- KV migration between servers (``kvmove serve/migrate --transport``): ``KV_TRANSPORTS``; there ``auto`` is nixl
  where installed, else ``http`` with a warning (kvmove.migration.endpoint chooses it). ``http`` is registered but
  never picked by a sync's ``auto``.
- ``LocalTransport`` (copies within one process) is not registered: nothing that spans processes may choose it.

The names are plain data, importable without torch (the CLI's ``--help`` lists them); the classes are imported
when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvmove.errors import KvmoveError

if TYPE_CHECKING:
    from kvmove.transport.base import (
        BufferDesc,
        EndpointInfo,
        Membership,
        Range,
        TransferStats,
        Transport,
        TransportError,
    )
    from kvmove.transport.cuda_ipc import CudaIpcTransport
    from kvmove.transport.gloo import GlooGroup, GlooTransport
    from kvmove.transport.http import HttpTransport
    from kvmove.transport.local import LocalTransport
    from kvmove.transport.nccl import NcclGroup, NcclTransport
    from kvmove.transport.nixl import NixlTransport
    from kvmove.transport.object_store import ObjectStoreTransport
    from kvmove.transport.rdt import RdtGlooTransport, RdtNixlTransport, create_rdt_group
    from kvmove.transport.shm import ShmTransport
    from kvmove.transport.slots import ACTOR_OPTIONS, ServesSlots

AUTO = "auto"
SYNC_TRANSPORTS = ("nixl", "rdt-nixl", "rdt-gloo", "gloo", "object-store", "nccl", "cuda-ipc", "shm")
"""The byte movers of a weight sync, in registry order."""
KV_TRANSPORTS = ("nixl", "http")
"""The data planes between KV-migration servers."""
AUTO_ORDER = ("nixl", "rdt-nixl", "rdt-gloo", "gloo")
"""What a sync's ``auto`` tries, best first."""

_LAZY = {
    "BufferDesc": "base",
    "EndpointInfo": "base",
    "Membership": "base",
    "Range": "base",
    "TransferStats": "base",
    "Transport": "base",
    "TransportError": "base",
    "CudaIpcTransport": "cuda_ipc",
    "GlooGroup": "gloo",
    "GlooTransport": "gloo",
    "HttpTransport": "http",
    "LocalTransport": "local",
    "NcclGroup": "nccl",
    "NcclTransport": "nccl",
    "NixlTransport": "nixl",
    "ObjectStoreTransport": "object_store",
    "RdtGlooTransport": "rdt",
    "RdtNixlTransport": "rdt",
    "create_rdt_group": "rdt",
    "ShmTransport": "shm",
    "ACTOR_OPTIONS": "slots",
    "ServesSlots": "slots",
}
_REGISTERED = (
    "NixlTransport",
    "RdtNixlTransport",
    "RdtGlooTransport",
    "GlooTransport",
    "ObjectStoreTransport",
    "NcclTransport",
    "CudaIpcTransport",
    "ShmTransport",
    "HttpTransport",
)


def __getattr__(name: str) -> Any:
    """The transport classes (and ``TRANSPORTS``, the registry), imported on first use."""
    if name == "TRANSPORTS":
        return _registry()
    if name in _LAZY:
        value = getattr(importlib.import_module(f"kvmove.transport.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvmove.transport' has no attribute {name!r}")


def _registry() -> dict[str, type[Transport]]:
    """The registry, by name, built once (its classes checked against the names this module owns)."""
    registry: dict[str, type[Transport]] | None = globals().get("TRANSPORTS")
    if registry is None:
        registry = {cls.name: cls for cls in (__getattr__(n) for n in _REGISTERED)}
        if tuple(registry) != (*SYNC_TRANSPORTS, "http") or set(KV_TRANSPORTS) - set(registry):
            raise RuntimeError(f"transport names {tuple(registry)} differ from SYNC_TRANSPORTS/KV_TRANSPORTS")
        globals()["TRANSPORTS"] = registry
    return registry


if TYPE_CHECKING:
    TRANSPORTS: dict[str, type[Transport]]


def available_transports() -> list[str]:
    """Names of the transports whose dependencies import here, in registry order; never raises."""
    return [name for name, cls in _registry().items() if cls.is_available()]


def get_transport(name: str, *, actors: bool = True) -> type[Transport]:
    """The transport class called ``name`` (``"auto"``: the first available of ``AUTO_ORDER``; without ``actors``
    only those that need no Ray actor).

    Unknown names are a KvmoveError; a known transport whose dependency is missing still resolves
    (constructing it raises MissingDependencyError naming the extra to install).
    """
    registry = _registry()
    if name == AUTO:
        available = [n for n in available_transports() if actors or not registry[n].needs_actor]
        best = next((n for n in AUTO_ORDER if n in available), None)
        if best is None:
            raise KvmoveError("no transport is available here (install 'kvmove[nixl]' or a torch with gloo)")
        return registry[best]
    if name not in registry:
        raise KvmoveError(f"unknown transport {name!r} (known: auto, {', '.join(registry)})")
    return registry[name]


__all__ = [
    "ACTOR_OPTIONS",
    "AUTO",
    "AUTO_ORDER",
    "KV_TRANSPORTS",
    "SYNC_TRANSPORTS",
    "TRANSPORTS",
    "BufferDesc",
    "CudaIpcTransport",
    "EndpointInfo",
    "GlooGroup",
    "GlooTransport",
    "HttpTransport",
    "LocalTransport",
    "Membership",
    "NcclGroup",
    "NcclTransport",
    "NixlTransport",
    "ObjectStoreTransport",
    "Range",
    "RdtGlooTransport",
    "RdtNixlTransport",
    "ServesSlots",
    "ShmTransport",
    "TransferStats",
    "Transport",
    "TransportError",
    "available_transports",
    "create_rdt_group",
    "get_transport",
]
