"""CUDA IPC: a reader maps the server's registered device buffers once and pulls with peer-to-peer copies.

Same host only. ``endpoint_info`` carries one CUDA IPC handle per registered buffer (PyTorch's own
reduction); ``connect`` opens them in the reader's process once; ``read`` is a device-to-device copy over
NVLink/PCIe, synchronized before it returns so the bytes are in place and the time is real.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvmove.transport.base import BufferDesc, EndpointInfo, Transport, TransportError


class CudaIpcTransport(Transport):
    name = "cuda-ipc"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise TransportError("the cuda-ipc transport needs a CUDA device")
        super().__init__()
        self._handles: dict[int, Any] = {}
        self._remote: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def is_available(cls) -> bool:
        try:
            return bool(torch.cuda.is_available())
        except Exception:
            return False

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        if not buf.is_cuda:
            raise TransportError("the cuda-ipc transport moves CUDA buffers only")
        self._handles[buffer_id] = reduce_tensor(buf)

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(self.name, self.endpoint, dict(self._handles))

    def _connect(self, peer: EndpointInfo) -> None:
        for buffer_id, (rebuild, args) in peer.payload.items():
            self._remote[(peer.endpoint, buffer_id)] = rebuild(*args)

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        src = self._remote.get((remote.endpoint, remote.buffer_id))
        if src is None:
            raise TransportError(f"buffer {remote.buffer_id} of {remote.endpoint} was not registered before connect")
        for ro, lo, n in spans.tolist():
            local[lo : lo + n].copy_(src[ro : ro + n], non_blocking=True)
        torch.cuda.current_stream(local.device).synchronize()

    def _close(self) -> None:
        self._remote.clear()
        self._handles.clear()
