"""``shm``: CPU buffers shared between the processes of one host, read in place: the CPU twin of cuda-ipc.

``register`` moves the buffer's storage into POSIX shared memory (PyTorch's ``file_system`` sharing: a named
segment under ``/dev/shm``, its lifetime kept by ``torch_shm_manager``; every view of the storage, in this
process, stays valid, since the storage's data pointer is swapped in place), and ``endpoint_info`` carries each
segment's name. ``connect`` opens a peer's segments once in the reader's process: a read is a memory copy of
the spans between the mapped segment and the local buffer (the same 2-D copy plans as ``local``), and
:meth:`~kvmove.transport.base.Transport.mapped` gives the segment itself, which a reader computes from in place
(an engine quantizing a trainer's arena into its parameters: ``maps_peers``), as cuda-ipc does with an opened IPC
handle. Same host only; never picked by ``auto`` (network transports are).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from kvmove.transport.base import BufferDesc, EndpointInfo, Transport, TransportError
from kvmove.transport.copies import copy_views, plan_copies

T = TypeVar("T")


ATTEMPTS = 4
"""How often a call that reaches ``torch_shm_manager`` is tried when the manager does not answer in time (it is a
daemon PyTorch starts on first use; on a loaded host its first answer can come late)."""


def _patiently(call: Callable[[], T]) -> T:
    """``call()``, tried again (after 0.5, 1, 2 s) while the shared-memory manager's connection times out."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except RuntimeError as exc:
            if "timed out" not in str(exc) or attempt == ATTEMPTS - 1:
                raise
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _open(seg: Segment) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared_filename_cpu(seg.manager, seg.handle, seg.storage_bytes)


class Segment(NamedTuple):
    """A registered buffer as a peer opens it: the shared storage's handle and the buffer's place in it."""

    manager: bytes
    handle: bytes
    storage_bytes: int
    offset: int
    nbytes: int


class ShmTransport(Transport):
    name = "shm"
    strided = True
    maps_peers = True

    def __init__(self) -> None:
        super().__init__()
        self._segments: dict[int, Segment] = {}
        self._remote: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def is_available(cls) -> bool:
        return True

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        if buf.device.type != "cpu":
            raise TransportError(f"the shm transport moves CPU buffers only, not {buf.device}")
        storage = buf.untyped_storage()
        try:
            manager, handle, size = _patiently(storage._share_filename_cpu_)
        except RuntimeError as exc:  # already shared another way (a file descriptor): no name to open it by
            raise TransportError(f"the shm transport cannot share this buffer by name: {exc}") from exc
        self._segments[buffer_id] = Segment(manager, handle, int(size), int(buf.storage_offset()), buf.numel())

    def endpoint_info(self) -> EndpointInfo:
        self._check_open()
        return EndpointInfo(self.name, self.endpoint, dict(self._segments))

    def _connect(self, peer: EndpointInfo) -> None:
        segments: dict[int, Any] = peer.payload or {}
        for buffer_id, seg in segments.items():
            seg = Segment(*seg)
            try:
                storage = _patiently(partial(_open, seg))
            except RuntimeError as exc:
                raise TransportError(f"cannot open shared buffer {buffer_id} of {peer.endpoint}: {exc}") from exc
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._remote[(peer.endpoint, buffer_id)] = whole[seg.offset : seg.offset + seg.nbytes]

    def _mapped(self, remote: BufferDesc) -> torch.Tensor:
        src = self._remote.get((remote.endpoint, remote.buffer_id))
        if src is None:
            raise TransportError(
                f"buffer {remote.buffer_id} is not registered with endpoint {remote.endpoint} (or was registered "
                "after this endpoint connected to it)"
            )
        return src

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        copy_views(self._mapped(remote), local, plan_copies(spans))
        self._count("views", int(spans[:, 2].sum()))

    def _close(self) -> None:
        self._remote.clear()
        self._segments.clear()
