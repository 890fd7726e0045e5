"""The trainer ranks' agreement: small objects broadcast or gathered among the framework's own processes.

Trainer ranks share their key, config, hellos and per-rank sync loops at init, and the outcome of every sync, over
a gloo group of the framework's default ``torch.distributed`` group (the trainer processes' own trust boundary).
One trainer rank needs no group. A failure on the rank that computes an agreed value reaches every rank as the
same one-line error (:meth:`TrainerGroup.agree`), so no rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from kvmove.errors import KvmoveError

T = TypeVar("T")


class TrainerGroup:
    """``rank`` of the trainer's ranks (the default process group's, or this process alone)."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank, self._dist, self._pg = rank, dist, None
        if dist.is_available() and dist.is_initialized():
            self.world = dist.get_world_size()
            if rank != dist.get_rank():
                raise KvmoveError(
                    f"trainer rank {rank} is rank {dist.get_rank()} of torch.distributed's default group: pass "
                    "each process its rank in that group"
                )
            self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.world > 1 else None
        else:
            self.world = 1
            if rank != 0:
                raise KvmoveError(
                    f"trainer rank {rank}, but torch.distributed is not initialized: with several trainer ranks, "
                    "initialize the default process group first (every rank then builds its trainer engine)"
                )

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self._pg is None:
            return value
        box = [value]
        self._dist.broadcast_object_list(box, src=self._global(0), group=self._pg)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank."""
        if self._pg is None:
            return [value]
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, value, group=self._pg)
        return out

    def agree(self, compute: Callable[[], T]) -> T:
        """``compute()`` on rank 0, its result on every rank; if it raised, every rank raises (rank 0 the original)."""
        value: Any = None
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                value = compute()
            except Exception as exc:
                failure = exc
        message = None if failure is None else (str(failure).strip() or type(failure).__name__).splitlines()[0]
        value, message = self.broadcast((value, message))
        if failure is not None:
            raise failure
        if message is not None:
            raise KvmoveError(f"trainer rank 0 failed: {message}")
        return value

    def check(self, failure: BaseException | None) -> None:
        """Every rank learns whether any rank failed; each raises its own failure, or the first other rank's."""
        text = None if failure is None else (str(failure).strip() or type(failure).__name__).splitlines()[0]
        messages = self.all_gather(text)
        if failure is not None:
            raise failure
        bad = next(((r, m) for r, m in enumerate(messages) if m is not None), None)
        if bad is not None:
            raise KvmoveError(f"trainer rank {bad[0]} failed: {bad[1]}")

    def _global(self, rank: int) -> int:
        assert self._pg is not None
        return int(self._dist.get_global_rank(self._pg, rank))

    def destroy(self) -> None:
        if self._pg is not None:
            self._dist.destroy_process_group(self._pg)
            self._pg = None
