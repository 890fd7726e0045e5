"""Reads answered by a Ray actor method: the ``ServesSlots`` mixin and the base of the Ray-object transports.

The server is a Ray actor whose class mixes in ``ServesSlots`` and is declared with ``ACTOR_OPTIONS``
(``@ray.remote(**ACTOR_OPTIONS)``, which turns on tensor transport and adds the ``kvmove`` concurrency
group). A client's ``read`` calls the server's ``kvmove_serve``, which returns views of the registered slot;
Ray moves them by the transport's ``tensor_transport`` (RDT NIXL, RDT gloo, or the object store).
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import numpy as np
import torch

from kvmove.transport.base import BufferDesc, EndpointInfo, Transport, TransportError
from kvmove.transport.optional import can_import, import_optional

RECEIVE_GROUP = "kvmove"
ACTOR_OPTIONS: dict[str, Any] = {"enable_tensor_transport": True, "concurrency_groups": {RECEIVE_GROUP: 1}}
"""Options for ``@ray.remote(**ACTOR_OPTIONS)`` on every actor class that uses a Ray-object transport."""

# NOTE: endpoints of this process by name, so that actor methods (which get only names) can find them.
_ENDPOINTS: weakref.WeakValueDictionary[str, ActorTransport] = weakref.WeakValueDictionary()


def import_ray() -> Any:
    return import_optional("ray", "", "Ray-based transports")


def local_endpoint(endpoint: str) -> ActorTransport:
    found = _ENDPOINTS.get(endpoint)
    if found is None:
        raise TransportError(f"endpoint {endpoint!r} is not open in this actor")
    return found


class ServesSlots:
    """Mixin for the Ray actor classes on both sides of a Ray-object transport (``rdt-*``, ``object-store``).

    Contract: the class is decorated ``@ray.remote(**ACTOR_OPTIONS)``; the transport endpoint is created
    inside the actor (its ``endpoint_info`` carries this actor's handle). Nothing else is required.
    """

    def kvmove_serve(self, endpoint: str, buffer_id: int, spans: np.ndarray) -> list[torch.Tensor]:
        """Views of ``(remote_offset, nbytes)`` spans of a registered buffer, for a peer's ``read``."""
        return local_endpoint(endpoint).serve(buffer_id, spans)

    def kvmove_receive(self, endpoint: str, buffer_id: int, offsets: list[int], tensors: list[torch.Tensor]) -> int:
        """Copy received ``tensors`` into a registered buffer at ``offsets`` (for two-sided RDT); bytes copied."""
        return local_endpoint(endpoint).land(buffer_id, offsets, tensors)


class ActorTransport(Transport):
    """A Ray-object transport endpoint living in a Ray actor that mixes in ``ServesSlots``."""

    tensor_transport: ClassVar[str | None] = None
    needs_actor = True

    def __init__(self) -> None:
        self._ray = import_ray()
        super().__init__()
        _ENDPOINTS[self.endpoint] = self

    @classmethod
    def is_available(cls) -> bool:
        return can_import("ray")

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        pass

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(self.name, self.endpoint, self._current_actor())

    def _current_actor(self) -> Any:
        try:
            return self._ray.get_runtime_context().current_actor
        except Exception as exc:
            raise TransportError(f"a {self.name} endpoint must live in a Ray actor that mixes in ServesSlots") from exc

    def serve(self, buffer_id: int, spans: np.ndarray) -> list[torch.Tensor]:
        buf = self._buffers.get(buffer_id)
        if buf is None:
            raise TransportError(f"buffer {buffer_id} is not registered with endpoint {self.endpoint}")
        return [buf[ro : ro + n] for ro, n in np.asarray(spans).tolist()]

    def land(self, buffer_id: int, offsets: list[int], tensors: list[torch.Tensor]) -> int:
        buf = self._buffers[buffer_id]
        for lo, t in zip(offsets, tensors, strict=True):
            buf[lo : lo + t.numel()].copy_(t)
        return sum(t.numel() for t in tensors)

    def _request(self, peer: EndpointInfo, remote: BufferDesc, spans: np.ndarray) -> Any:
        method = peer.payload.kvmove_serve
        if self.tensor_transport is not None:
            method = method.options(tensor_transport=self.tensor_transport)
        return method.remote(remote.endpoint, remote.buffer_id, np.ascontiguousarray(spans[:, [0, 2]]))

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        ref = self._request(peer, remote, spans)
        tensors = self._ray.get(ref)
        del ref
        for lo, t in zip(spans[:, 1].tolist(), tensors, strict=True):
            local[lo : lo + t.numel()].copy_(t)

    def _close(self) -> None:
        _ENDPOINTS.pop(self.endpoint, None)
