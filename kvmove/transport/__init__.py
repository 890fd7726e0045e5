"""Point-to-point byte movers behind one interface (``base.Transport``), registered by name.

``get_transport("auto")`` picks the best available, in the order of ``AUTO_ORDER``. ``http`` is registered but never
picked by ``auto``: it is the KV-migration servers' fallback data plane (kvmove.migration.endpoint chooses it there).
``LocalTransport`` (copies within one process) is not registered: nothing that spans processes may choose it.
"""

from __future__ import annotations

from kvmove.errors import KvmoveError
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
from kvmove.transport.slots import ACTOR_OPTIONS, ServesSlots

TRANSPORTS: dict[str, type[Transport]] = {
    t.name: t
    for t in (
        NixlTransport,
        RdtNixlTransport,
        RdtGlooTransport,
        GlooTransport,
        ObjectStoreTransport,
        NcclTransport,
        CudaIpcTransport,
        HttpTransport,
    )
}
AUTO_ORDER = ("nixl", "rdt-nixl", "rdt-gloo", "gloo")


def available_transports() -> list[str]:
    """Names of the transports whose dependencies import here, in registry order; never raises."""
    return [name for name, cls in TRANSPORTS.items() if cls.is_available()]


def get_transport(name: str, *, actors: bool = True) -> type[Transport]:
    """The transport class called ``name`` (``"auto"``: the first available of ``AUTO_ORDER``; without ``actors``
    only those that need no Ray actor).

    Unknown names are a KvmoveError; a known transport whose dependency is missing still resolves
    (constructing it raises MissingDependencyError naming the extra to install).
    """
    if name == "auto":
        available = [n for n in available_transports() if actors or not TRANSPORTS[n].needs_actor]
        best = next((n for n in AUTO_ORDER if n in available), None)
        if best is None:
            raise KvmoveError("no transport is available here (install 'kvmove[nixl]' or a torch with gloo)")
        return TRANSPORTS[best]
    if name not in TRANSPORTS:
        raise KvmoveError(f"unknown transport {name!r} (known: auto, {', '.join(TRANSPORTS)})")
    return TRANSPORTS[name]


__all__ = [
    "ACTOR_OPTIONS",
    "AUTO_ORDER",
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
    "TransferStats",
    "Transport",
    "TransportError",
    "available_transports",
    "create_rdt_group",
    "get_transport",
]
