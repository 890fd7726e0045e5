"""Raw transport bandwidth between two processes of the kind a sync uses (Ray actors, or plain processes).

Benchmarks report a sync's transfer speed as a fraction of this figure, measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

import torch

from kvmove.transport import get_transport
from kvmove.transport.base import Membership, TransportError
from kvmove.transport.gloo import GlooGroup
from kvmove.transport.slots import ACTOR_OPTIONS, ServesSlots, import_ray

PROCESS_KINDS = ("ray", "process")
PROCESS_TRANSPORTS = ("nixl", "gloo", "http")
"""Transports that run between two plain processes (the others need Ray actors)."""


class BandwidthResult(NamedTuple):
    """Median of ``repeats`` timed reads of ``nbytes`` (one range) after one untimed warm-up read."""

    transport: str
    processes: str
    nbytes: int
    repeats: int
    seconds: float
    gb_per_s: float


class PeerInfo(NamedTuple):
    """What a peer sends the other: its endpoint info and its registered buffer."""

    endpoint: Any
    buffer: Any


class Peer(ServesSlots):
    """One endpoint with one registered buffer; the server's is filled with seeded random bytes."""

    def __init__(self, transport: str, nbytes: int, seed: int | None, membership: Membership | None = None):
        self.transport = get_transport(transport).open(membership)
        if seed is None:
            self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        else:
            self.buf = torch.randint(
                0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
            )
        self.desc = self.transport.register(self.buf)

    def info(self) -> PeerInfo:
        return PeerInfo(self.transport.endpoint_info(), self.desc)

    def connect(self, info: Any) -> None:
        self.transport.connect(info)

    def read(self, remote: Any, ranges: Any) -> Any:
        return self.transport.read(remote, self.desc, ranges)

    def time_reads(self, remote: Any, repeats: int) -> list[float]:
        ranges = [(0, 0, min(remote.nbytes, self.desc.nbytes))]
        self.read(remote, ranges)
        return [self.read(remote, ranges).seconds for _ in range(repeats)]

    def registrations(self) -> int:
        return self.transport.registrations

    def contents(self) -> torch.Tensor:
        return self.buf.clone()

    def close(self) -> None:
        self.transport.close()


def measure_bandwidth(name: str, nbytes: int, repeats: int = 5, processes: str = "ray") -> BandwidthResult:
    """Time ``repeats`` reads of ``nbytes`` between two fresh endpoints; ``processes`` is "ray" or "process".

    "ray" starts two Ray actors on the running Ray session (``ray.init`` first; every transport);
    "process" starts two ``torch.multiprocessing`` processes (``PROCESS_TRANSPORTS`` only, no Ray needed; the
    ``http`` server process answers from the loopback web server its endpoint starts).
    """
    if processes not in PROCESS_KINDS:
        raise TransportError(f"processes must be one of {PROCESS_KINDS}, got {processes!r}")
    cls = get_transport(name)
    times = _time_ray(cls.name, nbytes, repeats) if processes == "ray" else _time_processes(cls.name, nbytes, repeats)
    seconds = statistics.median(times)
    return BandwidthResult(cls.name, processes, nbytes, repeats, seconds, nbytes / seconds / 1e9)


class ConcurrentResult(NamedTuple):
    """``pairs`` reader actors each reading ``nbytes`` from its own server actor, all at the same time."""

    transport: str
    pairs: int
    nbytes: int
    repeats: int
    per_reader_gb_per_s: float
    """Median over readers of each reader's median read rate."""
    aggregate_gb_per_s: float
    """Sum over readers of their median read rates."""


def measure_concurrent(name: str, nbytes: int, pairs: int, repeats: int = 5) -> ConcurrentResult:
    """Raw reads by ``pairs`` Ray actor pairs at once: the ceiling of a sync whose engine ranks read together
    (they share the machine's cores and memory bandwidth, which one idle pair does not see)."""
    ray = import_ray()
    if not ray.is_initialized():
        raise TransportError("measure_concurrent needs a running Ray session: call ray.init first")
    cls = get_transport(name)
    if cls.group_member or cls.actor_group:
        raise TransportError(f"{name} binds its members into one group; measure it one pair at a time")
    actor_cls = ray.remote(num_cpus=0, **ACTOR_OPTIONS)(Peer)
    servers = [actor_cls.remote(name, nbytes, i, {}) for i in range(pairs)]
    clients = [actor_cls.remote(name, nbytes, None, {}) for _ in range(pairs)]
    try:
        infos = ray.get([s.info.remote() for s in servers])
        ray.get([c.connect.remote(info) for c, (info, _) in zip(clients, infos, strict=True)])
        times = ray.get([c.time_reads.remote(remote, repeats) for c, (_, remote) in zip(clients, infos, strict=True)])
        rates = [nbytes / statistics.median(t) / 1e9 for t in times]
        ray.get([a.close.remote() for a in (*servers, *clients)])
        return ConcurrentResult(name, pairs, nbytes, repeats, statistics.median(rates), sum(rates))
    finally:
        for actor in (*servers, *clients):
            ray.kill(actor)


class PairMemberships(NamedTuple):
    """The server's and the reader's places in a two-member group (None: the transport forms none)."""

    server: Membership | None
    reader: Membership | None


def pair_memberships(name: str) -> PairMemberships:
    """Server's and reader's places in a two-member group, for transports whose endpoints form one (else None)."""
    if not get_transport(name).group_member:
        return PairMemberships(None, None)
    group = GlooGroup.local(2)  # picks a free loopback port for the group's store
    return PairMemberships(Membership(0, 2, group.host, group.port), Membership(1, 2, group.host, group.port))


def _time_ray(name: str, nbytes: int, repeats: int) -> list[float]:
    ray = import_ray()
    if not ray.is_initialized():
        raise TransportError("measure_bandwidth(processes='ray') needs a running Ray session: call ray.init first")
    places = pair_memberships(name)
    actor_cls = ray.remote(num_cpus=0, **ACTOR_OPTIONS)(Peer)
    server, client = (actor_cls.remote(name, nbytes, seed, places[r]) for r, seed in ((0, 0), (1, None)))
    try:
        backend = get_transport(name).actor_group
        if backend is not None:
            from kvmove.transport.rdt import create_rdt_group

            create_rdt_group([server, client], backend)
        info, remote = ray.get(server.info.remote())
        ray.get(client.connect.remote(info))
        times: list[float] = ray.get(client.time_reads.remote(remote, repeats))
        ray.get([server.close.remote(), client.close.remote()])
        return times
    finally:
        for actor in (server, client):
            ray.kill(actor)


def _time_processes(name: str, nbytes: int, repeats: int) -> list[float]:
    if name not in PROCESS_TRANSPORTS:
        raise TransportError(f"{name} needs Ray actors: measure it with processes='ray'")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    places = pair_memberships(name)
    to_client, to_server, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_serve_process, args=(name, nbytes, places[0], to_client, to_server)),
        ctx.Process(target=_read_process, args=(name, nbytes, repeats, places[1], to_client, to_server, results)),
    ]
    for p in procs:
        p.start()
    try:
        outcome = results.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    if isinstance(outcome, BaseException):
        raise outcome
    return list(outcome)


def _serve_process(name: str, nbytes: int, place: Membership | None, to_client: Any, to_server: Any) -> None:
    peer = Peer(name, nbytes, 0, place)
    to_client.put(peer.info())
    to_server.get()
    peer.close()


def _read_process(
    name: str, nbytes: int, repeats: int, place: Membership | None, to_client: Any, to_server: Any, results: Any
) -> None:
    try:
        peer = Peer(name, nbytes, None, place)
        info, remote = to_client.get()
        peer.connect(info)
        results.put(peer.time_reads(remote, repeats))
    except Exception as exc:  # handed to the parent, which raises it
        results.put(exc)
        raise
    finally:
        to_server.put(True)
    peer.close()


def copy_ceiling(source: str, target: str, nbytes: int, repeats: int = 3) -> float:
    """GB/s of a plain copy of ``nbytes`` from a buffer on device ``source`` to one on ``target``, in this process
    (median of ``repeats`` after a warm-up): the speed of light of any transport between those two memories
    (the P2P copy between two GPUs; a memory copy between two CPU processes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=source)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=target)
    src.fill_(1)

    def copy() -> float:
        _synchronize(source, target)
        t0 = time.perf_counter()
        dst.copy_(src)
        _synchronize(source, target)
        return time.perf_counter() - t0

    copy()
    seconds = statistics.median(copy() for _ in range(repeats))
    return nbytes / seconds / 1e9


def _synchronize(*devices: str) -> None:
    for device in devices:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
