"""An engine rank during syncs: pull each group's packed regions from their trainer ranks and load them.

Pulls go group by group, in plan order. After a group's bytes from a trainer rank have arrived, the engine
signals ``done`` so that trainer rank can release the group. With ``pipelined`` (v3) a loader thread copies
group g into the parameters while group g+1 is being pulled (double-buffered receive slots); otherwise each
pull is loaded before the next one starts.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import nn

from kvmove.sync.packing import unpack
from kvmove.sync.plan import Region, ShardingPlan
from kvmove.sync.schedule import PullPlan


class TrainerClient(Protocol):
    """How an engine rank reaches trainer ranks (Ray actor calls plus a transport, in practice)."""

    def pack(self, trainer: int, sync_id: int, pull_id: int) -> tuple[int, int]: ...
    def read(self, trainer: int, slot: int, recv: int, nbytes: int) -> float: ...
    def finish(self, trainer: int, sync_id: int, group: int, slot: int) -> None:
        """Free the trainer's slot and tell it this engine has all it pulls of ``group`` from it."""


class EngineStats(NamedTuple):
    rank: int
    seconds: float
    request_seconds: float
    transfer_seconds: float
    load_seconds: float
    bytes_received: int
    pulls: int
    peak_extra_bytes: int


class EngineRank:
    """Receiving side of one engine rank: its model's parameters, plan and registered receive slots."""

    def __init__(self, model: nn.Module, plan: ShardingPlan, recv: Mapping[str, Sequence[torch.Tensor]]) -> None:
        self.model, self.plan = model, plan
        self.recv = {strategy: list(r) for strategy, r in recv.items()}
        self.params = dict(model.named_parameters())

    def recv_bytes(self, strategy: str) -> int:
        return sum(r.numel() for r in self.recv.get(strategy, ()))

    def load(self, regions: Sequence[Region], buf: torch.Tensor) -> None:
        for region, data in zip(regions, unpack(buf, regions), strict=True):
            region.dst.apply(self.params[region.param].data).copy_(data)

    def run_sync(
        self,
        sync_id: int,
        strategy: str,
        pulls: PullPlan,
        client: TrainerClient,
        *,
        pipelined: bool,
        delay_s: float = 0.0,
    ) -> EngineStats:
        start = time.perf_counter()
        per_group: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(pulls.pulls):
            per_group[p.group].append(i)
        recv = self.recv[strategy]
        loader = _Loader(self, recv) if pipelined else None
        request = transfer = load = 0.0
        received = 0
        k = 0
        try:
            for group in sorted(per_group):
                if delay_s:
                    time.sleep(delay_s)  # fault injection: a slow replica
                for i in per_group[group]:
                    pull = pulls.pulls[i]
                    slot_index = k % len(recv)
                    k += 1
                    if loader is not None:
                        loader.wait_free(slot_index)
                    t0 = time.perf_counter()
                    slot, nbytes = client.pack(pull.trainer, sync_id, i)
                    request += time.perf_counter() - t0
                    transfer += client.read(pull.trainer, slot, slot_index, nbytes)
                    # NOTE: pulls are bucketed by (group, trainer), so this one pull is all of the group from it
                    client.finish(pull.trainer, sync_id, group, slot)
                    received += nbytes
                    regions = [self.plan.regions[r] for r in pull.regions]
                    if loader is None:
                        t2 = time.perf_counter()
                        self.load(regions, recv[slot_index])
                        load += time.perf_counter() - t2
                    else:
                        loader.submit(slot_index, regions)
        finally:
            if loader is not None:
                load += loader.close()
        return EngineStats(
            pulls.engine,
            time.perf_counter() - start,
            request,
            transfer,
            load,
            received,
            len(pulls.pulls),
            self.recv_bytes(strategy),
        )


class _Loader:
    """Background copier for pipelined syncs; tracks which receive slots still hold unloaded bytes."""

    def __init__(self, engine: EngineRank, recv: list[torch.Tensor]) -> None:
        self.engine, self.recv = engine, recv
        self.jobs: queue.Queue[tuple[int, list[Region]] | None] = queue.Queue()
        self.busy = [threading.Event() for _ in recv]
        for e in self.busy:
            e.set()
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kvmove-loader", daemon=True)
        self.thread.start()

    def wait_free(self, slot: int) -> None:
        self.busy[slot].wait()
        if self.error is not None:
            raise self.error

    def submit(self, slot: int, regions: list[Region]) -> None:
        self.busy[slot].clear()
        self.jobs.put((slot, regions))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            slot, regions = job
            t0 = time.perf_counter()
            try:
                self.engine.load(regions, self.recv[slot])
            except BaseException as exc:  # surfaced to the puller at its next wait
                self.error = exc
            self.seconds += time.perf_counter() - t0
            self.busy[slot].set()

    def close(self) -> float:
        self.jobs.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds
