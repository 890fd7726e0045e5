"""Trainer-side collectives over gloo: one process group per gather group, built from one TCP store.

Groups are created lazily and by name, each from its own prefix of the shared store, so only the members
of a group take part in creating it (no world-wide ordering of ``new_group`` calls is needed).
Collectives move raw bytes (uint8 views), so every dtype works.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
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
        self._groups: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()
        self.collective_calls = 0

    def group(self, ranks: Sequence[int]) -> Any:
        """The process group of ``ranks`` (sorted, must contain this rank); created on first use."""
        key = tuple(sorted(ranks))
        with self._lock:
            pg = self._groups.get(key)
            if pg is None:
                dist = self._dist
                prefix = dist.PrefixStore("g" + "-".join(map(str, key)), self._store)
                if self.device.startswith("cuda"):
                    nccl_options = dist.ProcessGroupNCCL.Options()
                    nccl_options._timeout = self.timeout
                    pg = dist.ProcessGroupNCCL(prefix, key.index(self.rank), len(key), nccl_options)
                else:
                    options = dist.ProcessGroupGloo._Options()
                    options._timeout = self.timeout
                    options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                    pg = dist.ProcessGroupGloo(prefix, key.index(self.rank), len(key), options)
                self._groups[key] = pg
            return pg

    def all_gather(self, ranks: Sequence[int], shard: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate the equal-shaped shards of ``ranks`` (in rank order) along ``dim``."""
        if len(ranks) == 1:
            return shard
        key = tuple(sorted(ranks))
        src = shard.contiguous()
        outs = [torch.empty_like(src) for _ in key]
        self.group(key).allgather(
            [[o.view(torch.uint8).view(-1) for o in outs]], [src.view(torch.uint8).view(-1)]
        ).wait()
        self.collective_calls += 1
        return torch.cat(outs, dim=dim)

    def broadcast(self, ranks: Sequence[int], tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Broadcast ``tensor`` (filled on trainer rank ``root``) to every rank of ``ranks``, in place."""
        key = tuple(sorted(ranks))
        if len(key) > 1:
            self.group(key).broadcast(tensor.view(torch.uint8).view(-1), key.index(root)).wait()
            self.collective_calls += 1
        return tensor

    def barrier(self) -> None:
        self.group(range(self.world)).barrier().wait()
