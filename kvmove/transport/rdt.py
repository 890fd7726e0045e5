"""``rdt-nixl`` and ``rdt-gloo``: Ray Direct Transport moves the slot views the server actor returns.

``rdt-nixl`` is one-sided: slots and receive buffers are registered with Ray's NIXL agent once, and the
client's ``ray.get`` reads the served views straight into views of its receive buffer (``set_target_for_ref``).
``rdt-gloo`` is two-sided: the client hands the served ref to its own ``kvmove_receive`` (in the ``kvmove``
concurrency group, so a blocked ``read`` does not stall it); Ray sends and receives over a gloo collective group
that the driver created with ``create_rdt_group`` before any read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvmove.transport.base import BufferDesc, EndpointInfo, TransportError
from kvmove.transport.nixl import NIXL_MODULE
from kvmove.transport.optional import can_import, import_optional
from kvmove.transport.slots import RECEIVE_GROUP, ActorTransport, import_ray


def create_rdt_group(actors: list[Any], backend: str = "gloo") -> Any:
    """Create a Ray collective group over ``actors`` (from the driver) and make every member aware of it.

    Ray records collective groups only in the creating process; members that submit RDT transfers
    themselves (our clients do) need the handle too, so each adopts it. Returns the communicator handle.
    """
    ray = import_ray()
    from ray.experimental.collective import create_collective_group

    handle = create_collective_group(actors, backend=backend)
    ray.get([actor.__ray_call__.remote(_adopt_group, handle) for actor in actors])
    return handle


def _adopt_group(_actor: Any, handle: Any) -> None:
    # NOTE: Ray 2.60 keeps this registry per process and has no public call to share a handle.
    from ray.experimental.collective.collective import RemoteCommunicatorManager

    RemoteCommunicatorManager.get().add_remote_communicator(handle)


class RdtNixlTransport(ActorTransport):
    """RDT over NIXL: one-sided, zero-copy on both sides, buffers registered once with Ray's NIXL agent."""

    name = "rdt-nixl"
    extra = "nixl"
    tensor_transport = "nixl"
    devices = frozenset({"cpu", "cuda"})

    def __init__(self) -> None:
        import_optional(NIXL_MODULE, "nixl", "the rdt-nixl transport")
        super().__init__()

    @classmethod
    def is_available(cls) -> bool:
        return can_import("ray") and can_import(NIXL_MODULE)

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        from ray.experimental.rdt import register_nixl_memory

        register_nixl_memory(buf)

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        from ray.experimental.rdt import set_target_for_ref

        ref = self._request(peer, remote, spans)
        # NOTE: Ray holds target buffers by weak reference: keep the views alive until ray.get returns.
        targets = [local[lo : lo + n] for lo, n in spans[:, 1:].tolist()]
        set_target_for_ref(ref, targets)
        self._ray.get(ref)
        del ref

    def _close(self) -> None:
        from ray.experimental.rdt import deregister_nixl_memory

        for buf in self._buffers.values():
            deregister_nixl_memory(buf)
        super()._close()


class RdtGlooTransport(ActorTransport):
    """RDT over a gloo collective group: two-sided; received tensors are copied into the receive buffer."""

    name = "rdt-gloo"
    tensor_transport = "gloo"
    rejoinable = False
    actor_group = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        from kvmove.transport.gloo import is_gloo_available

        return can_import("ray") and is_gloo_available()

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        from ray.experimental.collective import get_collective_groups

        me = self._current_actor()
        if not get_collective_groups([me, peer.payload], backend="gloo"):
            raise TransportError("rdt-gloo needs a gloo group over both actors: call create_rdt_group from the driver")
        buffer_id = next(i for i, b in self._buffers.items() if b is local)
        ref = self._request(peer, remote, spans)
        receive = me.kvmove_receive.options(concurrency_group=RECEIVE_GROUP)
        self._ray.get(receive.remote(self.endpoint, buffer_id, spans[:, 1].tolist(), ref))
        del ref
