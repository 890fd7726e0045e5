"""An engine rank during syncs: pull each group's regions from their trainer ranks and load them.

Pulls go group by group, in plan order. A packed pull asks the trainer rank to pack, reads the slot and
signals ``finish`` so that trainer rank can release the group; a direct pull reads straight from the trainer
rank's arena into the parameters (no request, no load), every parameter of the pull in one batch of reads.
The strategy's ``Overlap`` says how much overlaps: with ``direct_ahead`` every direct pull of the sync starts at
once, before the first packed one (arenas hold the step's weights before the sync starts, so nothing waits for a
gather), and stays in flight while the packed pulls go on; with ``interleave`` packed pulls alternate between
trainer ranks (the k-th group of each rank, then the (k+1)-th), so ranks of different pipeline stages gather and
pack at once instead of one stage after the other; with ``requests_ahead`` the next packed pulls are requested
before the current one is read, and with ``background_load`` a loader thread copies group g into the parameters
while group g+1 is read (one receive slot per pull in flight); otherwise each pull is loaded before the next one
starts.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.quant.quantizer import non_finite_blocks
from kvmove.sync.delta import warm as warm_delta
from kvmove.sync.delta.apply import Patch
from kvmove.sync.planning.entries import Entry
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.planning.schedule import Pull, PullPlan
from kvmove.sync.programs import Program, check_finite
from kvmove.sync.ranks.control import EngineStats, Packed
from kvmove.sync.strategies import Strategy
from kvmove.sync.transforms import Lander, mapped_cover


class TrainerClient(Protocol):
    """How an engine rank reaches trainer ranks: control by address (pack, finish), bytes by the transport."""

    def request(self, trainer: int, sync_id: int, pull_id: int, dense: bool = False) -> Any:
        """Ask ``trainer`` to pack pull ``pull_id`` (``dense``: whole, even in a delta sync); returns a handle for
        :meth:`wait` (does not block)."""

    def wait(self, handle: Any) -> Packed:
        """The slot and size of a requested pull, once the trainer has packed it."""

    def read(self, trainer: int, slot: int, recv: int, nbytes: int) -> float:
        """Read ``nbytes`` of ``trainer``'s serve slot into receive slot ``recv``; seconds."""

    def start_direct(self, pulls: Sequence[tuple[int, Sequence[tuple[str, Any]]]]) -> Any:
        """Start reading, for each (trainer, (parameter, byte spans) runs), the runs from that trainer's arena into
        the registered parameters, all as one batch; returns a handle for :meth:`wait_direct` (may not block)."""

    def wait_direct(self, handle: Any) -> float:
        """Seconds from the start of a batch of direct reads until its bytes were in place."""

    def finish(self, trainer: int, sync_id: int, group: int, slot: int, read_s: float = -1.0) -> None:
        """Free the trainer's slot and tell it this engine has all it pulls of ``group`` from it (``read_s``: the
        seconds its read of the slot took)."""


class EngineRank:
    """Receiving side of one engine rank: its model's parameters, plan and registered receive slots."""

    def __init__(self, model: nn.Module, plan: ShardingPlan, recv: Mapping[str, Sequence[torch.Tensor]]) -> None:
        self.model, self.plan = model, plan
        self.recv = {strategy: list(r) for strategy, r in recv.items()}
        self.params = dict(model.named_parameters())
        self._landers: dict[str, tuple[PullPlan, Lander]] = {}
        self.arenas: dict[int, torch.Tensor] = {}
        """Trainer rank -> its arena mapped into this process (``Transport.mapped``), for mapped pulls."""
        self._mapped: dict[tuple[str, int], Program] = {}
        self._mapped_stream: torch.cuda.Stream | None = None
        self.mapped_bytes = 0
        """FP8 bytes landed by mapped pulls since :meth:`take_mapped_bytes`."""
        for device in {t.device for r in self.recv.values() for t in r if t.is_cuda}:
            warm_delta(device, "engine")  # a first delta sync pays no compilation

    def map_arenas(self, arenas: Mapping[int, torch.Tensor]) -> None:
        """The arenas of the trainer ranks this rank's mapped pulls quantize from, mapped into this process."""
        self.arenas = dict(arenas)

    def mapped_program(self, strategy: str, pulls: PullPlan, i: int) -> Program:
        """The program quantizing mapped pull ``i`` from its trainer rank's mapped arena into the parameters (built
        once, at init: :meth:`prepare`)."""
        program = self._mapped.get((strategy, i))
        if program is None:
            pull, lander = pulls.pulls[i], self.lander(strategy, pulls)
            arena = self.arenas.get(pull.trainer)
            if arena is None:
                raise KvmoveError(f"engine rank {pulls.engine}: trainer rank {pull.trainer}'s arena is not mapped here")
            assert pulls.plan is not None
            entries = [pulls.plan.entries[m.entry] for m in pull.mapped]
            covers = [mapped_cover(arena, m, e.box) for m, e in zip(pull.mapped, entries, strict=True)]
            program = self._mapped[(strategy, i)] = lander.mapped_program(entries, covers)
        return program

    def start_mapped(self, strategy: str, pulls: PullPlan, order: Sequence[int]) -> Any:
        """Queue the programs of mapped pulls ``order`` on this rank's mapped stream (CPU: run them now); returns
        what :meth:`wait_mapped` waits on. Nothing is read back until then."""
        programs = [self.mapped_program(strategy, pulls, i) for i in order]
        device = self.arenas[pulls.pulls[order[0]].trainer].device if order else torch.device("cpu")
        stream = self._stream(device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # NOTE: what the loop queued first lands first
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for program in programs:
                program.run(check=False)
        self.mapped_bytes += sum(pulls.pulls[i].nbytes for i in order)
        return programs, stream

    def wait_mapped(self, handle: Any) -> None:
        """Wait for mapped programs started by :meth:`start_mapped`; NonFiniteWeightError if a cover held inf or
        NaN (one host synchronization for all of them)."""
        programs, stream = handle
        if stream is None:
            check_finite(programs)
            return
        torch.cuda.current_stream(stream.device).wait_stream(stream)  # NOTE: what follows sees the landed bytes
        with torch.cuda.stream(stream):  # the check's kernels and memory as the warm-up ran them: nothing first-time
            check_finite(programs)

    def take_mapped_bytes(self) -> int:
        out, self.mapped_bytes = self.mapped_bytes, 0
        return out

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if self._mapped_stream is None:
            self._mapped_stream = torch.cuda.Stream(device)
        return self._mapped_stream

    def recv_bytes(self, strategy: str) -> int:
        return sum(r.numel() for r in self.recv.get(strategy, ()))

    def lander(self, strategy: str, pulls: PullPlan) -> Lander:
        """What lands ``strategy``'s packed pulls in this rank's parameters (kvmove.sync.transforms); one per
        strategy, kept across syncs with the programs it replays."""
        if pulls.plan is None:
            raise KvmoveError(f"engine rank {pulls.engine}: its pull plan carries no entries")
        kept = self._landers.get(strategy)
        if kept is None or kept[0] is not pulls:
            kept = self._landers[strategy] = (pulls, Lander(self.params, self.plan, pulls.plan))
        return kept[1]

    def prepare(self, strategy: str, pulls: PullPlan) -> None:
        """Warm start: build, at init, the program landing each packed pull from each receive slot, and run each
        once, leaving the parameters as they are (``Lander.prepare``): a first sync costs what the next ones do."""
        lander, recv = self.lander(strategy, pulls), self.recv.get(strategy, [])
        assert pulls.plan is not None
        for i, pull in enumerate(pulls.pulls):
            if pull.packed:
                entries = [pulls.plan.entries[k] for k in pull.entries]
                for k, buf in enumerate(recv):
                    lander.prepare(entries, buf, (i, k))
        mapped = [i for i, p in enumerate(pulls.pulls) if p.mapped]
        if mapped:  # kernels compile for these shapes and strides on the stream a sync runs them on
            device = self.arenas[pulls.pulls[mapped[0]].trainer].device if self.arenas else torch.device("cpu")
            stream = self._stream(device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                programs = [self.mapped_program(strategy, pulls, i) for i in mapped]
                for program in programs:
                    program.warm(restore=True)
                non_finite_blocks([q.scale for p in programs for q in p.quantize])  # the sync's one check, not read
            if stream is not None:
                stream.synchronize()
        if recv and recv[0].is_cuda:  # the warm-up's copies are done before init returns
            torch.cuda.synchronize(recv[0].device)

    def run_sync(
        self,
        sync_id: int,
        strategy: Strategy,
        pulls: PullPlan,
        client: TrainerClient,
        *,
        delay_s: float = 0.0,
        pulled: Callable[[int], None] | None = None,
    ) -> EngineStats:
        """Every pull of ``pulls``, in group order; ``pulled(n)`` runs once the n-th pull finished (a fault hook)."""
        start = time.perf_counter()
        loop = _PullLoop(self, sync_id, strategy, pulls, client)
        group: int | None = None
        try:
            for n, i in enumerate(loop.order, start=1):
                pull = pulls.pulls[i]
                if pull.group != group and delay_s:
                    time.sleep(delay_s)  # fault injection: a slow replica
                group = pull.group
                loop.run(i, pull)
                if pulled is not None:
                    pulled(n)
        finally:
            loop.close()
        if loop.lander.pending_covers:
            raise KvmoveError(f"engine rank {pulls.engine}: {loop.lander.pending_covers} covers still miss pieces")
        return EngineStats(
            pulls.engine,
            time.perf_counter() - start,
            loop.request,
            loop.transfer,
            loop.load,
            loop.received,
            len(pulls.pulls),
            self.recv_bytes(strategy.name),
        )


class _PullLoop:
    """One sync's pulls of one engine rank: direct batches (ahead or inline), packed requests kept ahead, reads,
    loads (inline or background)."""

    def __init__(
        self, engine: EngineRank, sync_id: int, strategy: Strategy, pulls: PullPlan, client: TrainerClient
    ) -> None:
        self.engine, self.sync_id, self.pulls, self.client = engine, sync_id, pulls, client
        overlap = strategy.overlap
        by_group = sorted(range(len(pulls.pulls)), key=lambda i: pulls.pulls[i].group)
        direct = [i for i in by_group if pulls.pulls[i].direct]
        mapped = [i for i in by_group if pulls.pulls[i].mapped]
        self.packed = [i for i in by_group if pulls.pulls[i].packed]
        if overlap.interleave:
            self.packed = interleaved(pulls.pulls, self.packed)
        self.order = [*direct, *mapped, *self.packed] if overlap.direct_ahead else by_group
        self.request = self.transfer = self.load = 0.0
        self.received = self.k = 0
        self.strategy = strategy.name
        self.ahead = client.start_direct([self._direct(i) for i in direct]) if overlap.direct_ahead and direct else None
        # NOTE: like direct pulls, mapped ones read arenas that hold the step's weights before the sync starts: ahead,
        # their quantizations run on the mapped stream while packed pulls are requested, read and landed
        t0 = time.perf_counter()
        self.mapped = engine.start_mapped(self.strategy, pulls, mapped) if overlap.direct_ahead and mapped else None
        self.load += time.perf_counter() - t0
        self.recv = engine.recv.get(strategy.name, [])
        self.lander = engine.lander(strategy.name, pulls)
        self.lander.reset()
        background = overlap.background_load and self.packed and self.recv
        self.loader = _Loader(self.lander, self.recv) if background else None
        # NOTE: with requests ahead, the trainer packs pull k+1 while this rank reads pull k
        self.depth = 1 + overlap.requests_ahead
        self.pending = deque((i, self._request(i)) for i in self.packed[: self.depth])

    def _request(self, i: int) -> Any:
        pull = self.pulls.pulls[i]
        dense = not self.lander.accepts_delta(self._entries(pull), key=i)
        return self.client.request(pull.trainer, self.sync_id, i, dense)

    def _entries(self, pull: Pull) -> list[Entry]:
        assert self.pulls.plan is not None
        return [self.pulls.plan.entries[k] for k in pull.entries]

    def _direct(self, i: int) -> tuple[int, Sequence[tuple[str, Any]]]:
        return self.pulls.pulls[i].trainer, self.pulls.pulls[i].direct

    def run(self, i: int, pull: Pull) -> None:
        if pull.mapped:
            if self.mapped is None:  # inline: quantized into the parameters before the next pull
                t0 = time.perf_counter()
                self.engine.wait_mapped(self.engine.start_mapped(self.strategy, self.pulls, [i]))
                self.load += time.perf_counter() - t0
            self.received += pull.nbytes
            return
        if pull.direct:
            if self.ahead is None:  # inline: this pull's parameters as one batch, done before the next pull
                self.transfer += self.client.wait_direct(self.client.start_direct([self._direct(i)]))
            self.received += pull.nbytes
            return
        j, handle = self.pending.popleft()
        assert j == i, "packed pulls are requested in the order they are read"
        slot_index = self.k % len(self.recv)
        if self.loader is not None:
            self.loader.wait_free(slot_index)
        t0 = time.perf_counter()
        packed = self.client.wait(handle)
        self.request += time.perf_counter() - t0
        if self.k + self.depth < len(self.packed):
            nxt = self.packed[self.k + self.depth]
            self.pending.append((nxt, self._request(nxt)))
        self.k += 1
        read_s = 0.0
        if packed.nbytes:  # an empty delta (nothing changed) has nothing to read
            read_s = self.client.read(pull.trainer, packed.slot, slot_index, packed.nbytes)
        self.transfer += read_s
        # NOTE: pulls are bucketed by (group, trainer), so this one pull is all of the group from it
        self.client.finish(pull.trainer, self.sync_id, pull.group, packed.slot, read_s)
        self.received += packed.nbytes
        entries = self._entries(pull)
        patch = Patch.of(packed.encoding, packed.changed, [n for e in entries for n in e.sizes])
        if patch is not None and not patch.changed:  # nothing changed: the parameters hold this payload already
            return
        if self.loader is None:
            t2 = time.perf_counter()
            self.lander.land(entries, self.recv[slot_index], (i, slot_index), patch)
            self.load += time.perf_counter() - t2
        else:
            self.loader.submit(slot_index, entries, (i, slot_index), patch)

    def close(self) -> None:
        try:
            if self.ahead is not None:
                self.transfer += self.client.wait_direct(self.ahead)
            if self.mapped is not None:
                t0 = time.perf_counter()
                self.engine.wait_mapped(self.mapped)
                self.load += time.perf_counter() - t0
        finally:
            if self.loader is not None:
                self.load += self.loader.close()


def interleaved(pulls: Sequence[Pull], order: Sequence[int]) -> list[int]:
    """``order`` (pull indices in group order) re-ordered as the k-th pull of every trainer rank, then the (k+1)-th:
    each rank still sees its own pulls in group order (it gathers them in that order), but no rank waits for another
    rank's groups to be read first."""
    seen: dict[int, int] = {}
    rank = []
    for i in order:
        t = pulls[i].trainer
        rank.append((seen.get(t, 0), t, pulls[i].group, i))
        seen[t] = seen.get(t, 0) + 1
    return [i for *_, i in sorted(rank)]


class _Loader:
    """Background lander for overlapped syncs; tracks which receive slots still hold unlanded bytes."""

    def __init__(self, lander: Lander, recv: list[torch.Tensor]) -> None:
        self.lander, self.recv = lander, recv
        self.jobs: queue.Queue[tuple[int, list[Entry], Hashable, Patch | None] | None] = queue.Queue()
        self.busy = [threading.Event() for _ in recv]
        for e in self.busy:
            e.set()
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.stream = torch.cuda.Stream(recv[0].device) if recv and recv[0].is_cuda else None
        self.thread = threading.Thread(target=self._run, name="kvmove-loader", daemon=True)
        self.thread.start()

    def wait_free(self, slot: int) -> None:
        self.busy[slot].wait()
        if self.error is not None:
            raise self.error

    def submit(self, slot: int, entries: list[Entry], key: Hashable, patch: Patch | None = None) -> None:
        self.busy[slot].clear()
        self.jobs.put((slot, entries, key, patch))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            slot, entries, key, patch = job
            t0 = time.perf_counter()
            try:
                if self.stream is not None:  # loads overlap the next read, which runs on the default stream
                    with torch.cuda.stream(self.stream):
                        self.lander.land(entries, self.recv[slot], key, patch)
                else:
                    self.lander.land(entries, self.recv[slot], key, patch)
            except BaseException as exc:  # surfaced to the puller at its next wait
                self.error = exc
            self.seconds += time.perf_counter() - t0
            self.busy[slot].set()

    def close(self) -> float:
        self.jobs.put(None)
        self.thread.join()
        if self.error is not None:
            raise KvmoveError(f"loading pulled bytes failed: {self.error}") from self.error
        return self.seconds
