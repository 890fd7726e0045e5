"""``nixl``: NIXL agents (UCX backend) reading straight out of a peer's pre-registered memory.

Two ways to let a peer read: ``endpoint_info()`` (every registered buffer, whole, for the endpoint's life: what a
weight sync's fixed slots need) or ``grant(spans)`` (only those spans, registered for the grant and deregistered by
``revoke``, published as partial agent metadata that names nothing else: what one KV migration needs). A peer
reading again from an endpoint it knows merges the new metadata into what it has (one connection per peer pair,
however many grants).

NOTE: deregistration makes a late READ fail only where the UCX transport enforces remote keys (RDMA); over tcp
and shared memory (cma) UCX reads whatever the address holds, so the owner scrubs granted memory when a grant ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvmove.transport.base import (
    BufferDesc,
    EndpointInfo,
    ReadItem,
    Transport,
    TransportError,
    merged_intervals,
)
from kvmove.transport.optional import can_import, import_optional

NIXL_MODULE = "nixl._api"


def import_nixl() -> Any:
    """The NIXL Python API (``nixl._api``), or MissingDependencyError naming the extra. NIXL's log lines go to
    stderr (its own handler writes to stdout, where ``--json`` output lives)."""
    api = import_optional(NIXL_MODULE, "nixl", "the nixl transport")
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)
    return api


class Prepared(NamedTuple):
    """A prepared NIXL READ: its cache key (the remote buffer, each local buffer and its spans) and its handle."""

    key: tuple[Any, ...]
    handle: Any


class NixlTransport(Transport):
    """One NIXL agent per endpoint; ``read`` is a one-sided READ of many descriptors in one request.

    A READ request is prepared once per (remote buffer, local buffer, ranges) and re-posted by later reads
    with the same ranges (a sync plan repeats every sync); at most ``max_prepared`` are kept. A batch
    (``start_reads``) posts one request per remote buffer, whatever the number of local buffers it fills (a
    descriptor may point into any registered local memory), and polls them all until done.
    """

    name = "nixl"
    extra = "nixl"
    devices = frozenset({"cpu", "cuda"})

    def __init__(
        self,
        *,
        backends: tuple[str, ...] = ("UCX",),
        timeout_s: float = 120.0,
        max_prepared: int = 1024,
        net_device: str | None = None,
    ):
        """``net_device``: the only network interface UCX may listen and connect on (None: all of them, or what
        ``UCX_NET_DEVICES`` in the environment says, which wins)."""
        api = import_nixl()
        super().__init__()
        self._backends = list(backends)
        self._agent = _quiet_agent(api, self.endpoint, self._backends, net_device)
        self._reg_descs: list[Any] = []
        self._grants: dict[bytes, list[Any]] = {}
        self._remote_agents: dict[str, str] = {}
        self._prepared: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._timeout_s = timeout_s
        self._max_prepared = max_prepared

    @classmethod
    def is_available(cls) -> bool:
        return can_import(NIXL_MODULE)

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        descs = self._agent.register_memory(buf)
        if descs is None:
            raise TransportError(f"NIXL could not register buffer {buffer_id}")
        self._reg_descs.append(descs)

    def endpoint_info(self) -> EndpointInfo:
        self._check_open()
        return EndpointInfo(self.name, self.endpoint, self._agent.get_agent_metadata())

    @property
    def open_grants(self) -> int:
        """Grants made by ``grant`` and not yet revoked."""
        return sum(len(regs) for regs in self._grants.values())

    def grant(self, spans: Mapping[int, Sequence[tuple[int, int]]]) -> EndpointInfo:
        """Endpoint info whose holder may read only ``spans`` (buffer id -> ``(offset, nbytes)``): those spans are
        registered now, until ``revoke``, and the info is partial metadata naming them alone."""
        self._check_open()
        regions, memory = [], "DRAM"
        for buffer_id, ranges in spans.items():
            buf = self._buffers.get(buffer_id)
            if buf is None:
                raise TransportError(f"buffer {buffer_id} is not registered with endpoint {self.endpoint}")
            memory, device = _memory(buf.device.type), max(buf.get_device(), 0)
            bounds = merged_intervals(np.asarray(ranges, dtype=np.int64).reshape(-1, 2), buf.numel())
            regions += [(buf.data_ptr() + start, end - start, device, "") for start, end in bounds.tolist()]
        if not regions:
            raise TransportError("a grant needs at least one non-empty span")
        regs = self._agent.register_memory(regions, memory, self._backends)
        payload = bytes(self._agent.get_partial_agent_metadata(regs, True, self._backends))
        self._grants.setdefault(payload, []).append(regs)
        return EndpointInfo(self.name, self.endpoint, payload)

    def revoke(self, info: EndpointInfo) -> None:
        """Deregister what the grant ``info`` carries. Idempotent."""
        regs = self._grants.get(bytes(info.payload))
        if regs:
            self._agent.deregister_memory(regs.pop())
            if not regs:
                del self._grants[bytes(info.payload)]

    def _connect(self, peer: EndpointInfo) -> None:
        # NOTE: a known peer's new metadata is merged into what we have (same connection): removing and re-adding
        # the agent would open a new connection each time and leave the old one behind on both sides
        self._drop_prepared(peer.endpoint)
        self._remote_agents[peer.endpoint] = self._agent.add_remote_agent(peer.payload)

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        self._finish(self._post([ReadItem(peer, remote, local, spans)]))

    def _forget(self, key: tuple[Any, ...] | None) -> None:
        handle = self._prepared.pop(key, None) if key is not None else None
        if handle is not None:
            with contextlib.suppress(Exception):  # NOTE: a handle of a failed transfer may refuse to go quietly
                self._agent.release_xfer_handle(handle)

    def _start(self, items: list[ReadItem]) -> Any:
        posted = self._post(items)
        return lambda: self._finish(posted)

    def _prepare(self, items: list[ReadItem]) -> None:
        for group in _by_remote(items):
            self._handle(group)

    def _post(self, items: list[ReadItem]) -> list[tuple[tuple[Any, ...], Any, str, str]]:
        """One READ per remote buffer of ``items``, posted: (key, handle, remote endpoint, state) of each."""
        posted = []
        for group in _by_remote(items):
            endpoint, key = group[0].remote.endpoint, None
            try:
                key, handle = self._handle(group)
                state = self._agent.transfer(handle)
            except Exception as exc:  # NOTE: NIXL's own errors (a span the peer never registered, a gone peer)
                self._forget(key)
                raise TransportError(f"NIXL READ from {endpoint} refused: {exc!r}") from exc
            if state not in ("PROC", "DONE"):
                self._forget(key)
                raise TransportError(f"NIXL READ from {endpoint} could not start (state {state})")
            posted.append((key, handle, endpoint, state))
        return posted

    def _finish(self, posted: list[tuple[tuple[Any, ...], Any, str, str]]) -> None:
        deadline = time.monotonic() + self._timeout_s
        for key, handle, endpoint, state in posted:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransportError(f"NIXL READ from {endpoint} still running after {self._timeout_s:.0f} s")
                time.sleep(0)  # NOTE: yield the GIL between polls: a pull must not starve the decode loop's thread
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as exc:  # NOTE: a peer that vanished mid-READ
                    self._forget(key)
                    raise TransportError(f"NIXL READ from {endpoint} failed: {exc!r}") from exc
            if state != "DONE":
                self._forget(key)
                raise TransportError(f"NIXL READ from {endpoint} failed (state {state})")

    def _handle(self, group: list[ReadItem]) -> Prepared:
        """The prepared READ of ``group`` (reads of one remote buffer), made once and then reused."""
        remote = group[0].remote
        key = (remote.endpoint, remote.buffer_id, *((i.local.data_ptr(), i.spans.tobytes()) for i in group))
        handle = self._prepared.get(key)
        if handle is not None:
            self._prepared.move_to_end(key)
            return Prepared(key, handle)
        local = np.concatenate([_descs(i.local.data_ptr(), max(i.local.get_device(), 0), i.spans, 1) for i in group])
        remote_descs = np.concatenate([_descs(remote.address, remote.device_id, i.spans, 0) for i in group])
        kind = group[0].local.device.type
        handle = self._agent.initialize_xfer(
            "READ",
            self._agent.get_xfer_descs(local, _memory(kind)),
            self._agent.get_xfer_descs(remote_descs, _memory(remote.device)),
            self._remote_agents[remote.endpoint],
        )
        self._prepared[key] = handle
        if len(self._prepared) > self._max_prepared:
            self._agent.release_xfer_handle(self._prepared.popitem(last=False)[1])
        return Prepared(key, handle)

    def _drop_prepared(self, endpoint: str) -> None:
        for key in [k for k in self._prepared if k[0] == endpoint]:
            self._agent.release_xfer_handle(self._prepared.pop(key))

    def _close(self) -> None:
        for handle in self._prepared.values():
            self._agent.release_xfer_handle(handle)
        self._prepared.clear()
        for grants in self._grants.values():
            for regs in grants:
                self._agent.deregister_memory(regs)
        self._grants.clear()
        for agent_name in self._remote_agents.values():
            self._agent.remove_remote_agent(agent_name)
        for descs in self._reg_descs:
            self._agent.deregister_memory(descs)
        self._reg_descs.clear()


PROGRESS_DELAY_US = 2000


def _quiet_agent(api: Any, name: str, backends: list[str], net_device: str | None = None) -> Any:
    """A NIXL agent whose progress thread sleeps between polls (and whose UCX uses only ``net_device``).

    NOTE: NIXL's Python wrapper hard-codes a zero delay, so its progress thread spins a whole core even when
    idle (measured here: 5.0 CPU-seconds per 5 idle seconds; with the delay 0.07). One spinning core per rank
    process starves every other rank on a small machine. The passive side still needs the thread (for
    connection wire-up), so it stays on, with the delay set on the config just before the agent is built.
    """
    real = api.nixlBind.nixlAgent

    def build(agent_name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, config)

    api.nixlBind.nixlAgent = build
    pinned = net_device is not None and "UCX_NET_DEVICES" not in os.environ
    if pinned:
        os.environ["UCX_NET_DEVICES"] = str(net_device)  # NOTE: UCX reads it when the agent's context is made
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=backends))
    finally:
        api.nixlBind.nixlAgent = real
        if pinned:
            del os.environ["UCX_NET_DEVICES"]


def _descs(base: int, device_id: int, spans: np.ndarray, column: int) -> np.ndarray:
    """``(n, 3)`` uint64 NIXL descriptors (address, length, device id) of one side of ``spans``."""
    out = np.empty((len(spans), 3), dtype=np.uint64)
    out[:, 0] = base + spans[:, column]
    out[:, 1] = spans[:, 2]
    out[:, 2] = device_id
    return out


def _by_remote(items: list[ReadItem]) -> list[list[ReadItem]]:
    """Reads grouped by remote buffer and local device kind (one NIXL request each), in first-seen order."""
    groups: dict[tuple[str, int, str], list[ReadItem]] = {}
    for i in items:
        groups.setdefault((i.remote.endpoint, i.remote.buffer_id, i.local.device.type), []).append(i)
    return list(groups.values())


def _memory(device_type: str) -> str:
    return "DRAM" if device_type == "cpu" else "VRAM"
