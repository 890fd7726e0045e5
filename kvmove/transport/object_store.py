"""``object-store``: the honest baseline — the server actor returns slot views, Ray's object store carries them."""

from __future__ import annotations

from kvmove.transport.slots import ActorTransport


class ObjectStoreTransport(ActorTransport):
    """Pull through ``ray.get`` of the server's ``kvmove_serve`` result (serialize, plasma, deserialize, copy)."""

    name = "object-store"
    tensor_transport = None
