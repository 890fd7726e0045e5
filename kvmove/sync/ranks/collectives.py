"""Trainer-side collectives: one process group per gather group (NCCL on GPUs, gloo on CPU), from one TCP store.

Groups are created by name, each from its own prefix of the shared store, so only the members of a group take
part in creating it (no world-wide ordering of ``new_group`` calls is needed). :meth:`Collectives.warm` creates,
at init, every group a rank will use and runs one tiny collective in each, in one global order (so the NCCL
communicators exist before the first sync: a first sync costs what the next ones do). Collectives move raw bytes
(uint8 views), so every dtype works. Members that share one GPU (several trainer ranks placed on one device) get a
gloo group that stages the bytes through host memory: NCCL refuses two ranks of one communicator on one GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch


class Collectives:
    """Process groups among trainer ranks (gloo on CPU, NCCL with ``device`` "cuda:N"); ``rank`` is ours."""

    def __init__(
        self, rank: int, world: int, host: str, port: int, timeout_s: float = 120.0, device: str = "cpu"
    ) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.host, self.device = rank, world, host, device
        self.timeout = timedelta(seconds=timeout_s)
        self._dist = dist
        self._store = dist.TCPStore(host, port, world, rank == 0, timeout=self.timeout)
        self._store.set(f"device/{rank}", device)
        self._groups: dict[tuple[int, ...], Any] = {}
        self._staged: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()
        self.collective_calls = 0

    def group(self, ranks: Sequence[int]) -> Any:
        """The process group of ``ranks`` (sorted, must contain this rank); created on first use."""
        key = tuple(sorted(ranks))
        with self._lock:
            pg = self._groups.get(key)
            if pg is None:
                pg = self._groups[key] = self._create(key)
            return pg

    def _create(self, key: tuple[int, ...]) -> Any:
        dist = self._dist
        prefix = dist.PrefixStore("g" + "-".join(map(str, key)), self._store)
        if self.device.startswith("cuda") and not self._shares_device(key):
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = self.timeout
            return dist.ProcessGroupNCCL(prefix, key.index(self.rank), len(key), nccl_options)
        if self.device.startswith("cuda"):
            self._staged.add(key)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(prefix, key.index(self.rank), len(key), options)

    def _shares_device(self, key: tuple[int, ...]) -> bool:
        """Whether two members of ``key`` run on one device (every rank published its device at construction)."""
        devices = [self._store.get(f"device/{r}").decode() for r in key]
        return len(set(devices)) < len(devices)

    def warm(self, groups: Iterable[Sequence[int]]) -> None:
        """Create every group of ``groups`` that holds this rank and run one collective in each (collective: every
        rank calls it with the same groups; they are visited in one sorted order, so no two ranks wait on each other
        in opposite orders)."""
        mine = sorted({tuple(sorted(g)) for g in groups if self.rank in g and len(g) > 1})
        for key in mine:
            one = torch.zeros(1, dtype=torch.uint8, device=self.device)
            self.broadcast(key, one, key[0])
        self.collective_calls = 0

    def all_gather(self, ranks: Sequence[int], shard: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate the equal-shaped shards of ``ranks`` (in rank order) along ``dim``."""
        if len(ranks) == 1:
            return shard
        key = tuple(sorted(ranks))
        pg = self.group(key)
        staged = key in self._staged
        src = shard.contiguous().cpu() if staged else shard.contiguous()
        outs = [torch.empty_like(src) for _ in key]
        pg.allgather([[o.view(torch.uint8).view(-1) for o in outs]], [src.view(torch.uint8).view(-1)]).wait()
        self.collective_calls += 1
        full = torch.cat(outs, dim=dim)
        return full.to(shard.device) if staged else full

    def broadcast(self, ranks: Sequence[int], tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Broadcast ``tensor`` (filled on trainer rank ``root``) to every rank of ``ranks``, in place."""
        key = tuple(sorted(ranks))
        if len(key) > 1:
            pg = self.group(key)
            staged = key in self._staged
            data = tensor.contiguous().cpu() if staged else tensor
            pg.broadcast(data.view(torch.uint8).view(-1), key.index(root)).wait()
            if staged:
                tensor.copy_(data)
            self.collective_calls += 1
        return tensor

    def barrier(self) -> None:
        self.group(range(self.world)).barrier().wait()
