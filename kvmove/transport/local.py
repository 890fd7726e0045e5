"""``local``: reads between endpoints of one process (a plain memory copy), for code paths whose two sides live in
one process: the GPU resume benchmark on a machine without NIXL, and its CPU twin.

Endpoints find each other by name in a process-wide table (weak: a closed or collected endpoint is gone); a read
runs its spans as a 2-D copy plan with torch strided-view copies (``kvmove.transport.copies``: the CPU twin of
the CUDA transports' 2-D copies). It never crosses a process, so servers never pick it.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from kvmove.transport.base import BufferDesc, EndpointInfo, Transport, TransportError
from kvmove.transport.copies import copy_views, plan_copies

_ENDPOINTS: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_TABLE_LOCK = threading.Lock()


class LocalTransport(Transport):
    name = "local"
    strided = True
    maps_peers = True

    def __init__(self) -> None:
        super().__init__()
        with _TABLE_LOCK:
            _ENDPOINTS[self.endpoint] = self

    @classmethod
    def is_available(cls) -> bool:
        return True

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        pass

    def endpoint_info(self) -> EndpointInfo:
        self._check_open()
        return EndpointInfo(self.name, self.endpoint)

    def _connect(self, peer: EndpointInfo) -> None:
        with _TABLE_LOCK:
            if peer.endpoint not in _ENDPOINTS:
                raise TransportError(f"local endpoint {peer.endpoint} is not in this process (or was closed)")

    def _mapped(self, remote: BufferDesc) -> torch.Tensor:
        with _TABLE_LOCK:
            owner = _ENDPOINTS.get(remote.endpoint)
        src = None if owner is None else owner._buffers.get(remote.buffer_id)
        if src is None:
            raise TransportError(f"local buffer {remote.endpoint}#{remote.buffer_id} is gone")
        return src

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        copy_views(self._mapped(remote), local, plan_copies(spans))
        self._count("views", int(spans[:, 2].sum()))

    def _close(self) -> None:
        with _TABLE_LOCK:
            _ENDPOINTS.pop(self.endpoint, None)
