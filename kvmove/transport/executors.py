"""Copy executors on CUDA: who moves a batch of copies (the driver's copy engine or a Triton kernel), and the rule
that picks one per plan.

A batch is a :class:`~kvmove.transport.copies.CopyPlan` whose offsets are relative to one *base* tensor's address
(``base``: any device tensor; every read of a batch, whatever buffers it touches, is one plan). An executor is
built once per batch (warm start: a Triton executor uploads its descriptor tables then) and ``run`` enqueues the
batch on a stream, returning at once.

The rule (:func:`assign_executors`) splits a batch's copies by where each executor is slow:
- 2-D copies with rows narrower than :data:`NARROW_ROW` go to the kernel: the copy engine walks a 2-D copy row by
  row and narrow rows run far below the device's copy rate (a row-parallel half of an MoE down projection is
  1.5 KB rows at a 3 KB pitch);
- inside one GPU, a batch the kernel takes any part of goes to it whole, and so does a batch of more than
  :data:`MANY_COPIES` copies: each driver call costs microseconds of Python and driver time, a launch covers them
  all, and the two shares would run one after the other. Measured on one H200 (pp=2 -> tp=2 colocated, 12.4 GB,
  v3, commit 7eca0c6): kernel share then driver share 13.4 ms, driver only 13.8 ms, kernel whole 8.7 ms;
- the rest (a few large copies; on a peer read every copy but narrow rows: the link, not issue overhead, bounds
  those, and the copy engines reach it without taking SMs from the engine) goes to the driver's copy engine.
The kernel's share runs first, then the driver's, on one stream. Without triton everything goes to the driver.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvmove.transport.base import TransportError
from kvmove.transport.copies import HEIGHT, WIDTH, CopyPlan
from kvmove.transport.cuda_driver import driver, run_plan

NARROW_ROW = 16 << 10
"""2-D copies with rows narrower than this (bytes) run on SMs, not on the copy engine."""
MANY_COPIES = 64
"""Batches inside one GPU with more copies than this run as one kernel launch, not one driver call each."""


class CopyExecutor(ABC):
    """Moves one batch (offsets relative to ``base``'s address) on a CUDA stream; built once per batch."""

    name: ClassVar[str]

    def __init__(self, plan: CopyPlan, base: torch.Tensor, what: str) -> None:
        self.plan, self.base, self.what = plan, base, what

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this executor can run here; never raises."""

    @abstractmethod
    def run(self, stream: torch.cuda.Stream) -> None:
        """Enqueue the batch on ``stream`` (the caller synchronizes)."""


class DriverCopies(CopyExecutor):
    """``cuMemcpyAsync`` / ``cuMemcpy2DAsync`` per copy (``kvmove.transport.cuda_driver``)."""

    name = "driver"

    @classmethod
    def is_available(cls) -> bool:
        return driver() is not None

    def run(self, stream: torch.cuda.Stream) -> None:
        drv = driver()
        if drv is None:
            raise TransportError(f"{self.what}: libcuda could not be loaded")
        at = self.base.data_ptr()
        run_plan(drv, self.plan, at, at, stream.cuda_stream, self.what)


class TritonCopies(CopyExecutor):
    """The batched copy kernel (``kvmove.transport.triton_copy``): a few launches for the whole batch."""

    name = "triton"

    def __init__(self, plan: CopyPlan, base: torch.Tensor, what: str) -> None:
        from kvmove.transport.tiling import plan_tiles
        from kvmove.transport.triton_copy import TritonTiles

        super().__init__(plan, base, what)
        self.tiles = TritonTiles(plan_tiles(plan), base)
        with torch.cuda.device(base.device):
            self.tiles.warm()

    @classmethod
    def is_available(cls) -> bool:
        return triton_available()

    def run(self, stream: torch.cuda.Stream) -> None:
        with torch.cuda.device(self.base.device), torch.cuda.stream(stream):
            self.tiles.run()


COPY_EXECUTORS: dict[str, type[CopyExecutor]] = {"driver": DriverCopies, "triton": TritonCopies}
"""Executors of a CUDA copy batch, by name (``assign_executors`` splits a batch between them)."""


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def assign_executors(plan: CopyPlan, peer: bool, available: frozenset[str] | None = None) -> list[tuple[str, CopyPlan]]:
    """``plan``'s copies split between executors by the module docstring's rule: (executor, its copies) pairs, in
    the order to run them. ``peer``: the plan reads another GPU's memory; ``available``: the executors that may run
    (default: those that can run here)."""
    names = available if available is not None else frozenset(n for n, e in COPY_EXECUTORS.items() if e.is_available())
    if not names & {"driver", "triton"}:
        raise TransportError("no CUDA copy executor can run here (neither libcuda nor triton loads)")
    c = plan.copies
    kernel = (c[:, HEIGHT] > 1) & (c[:, WIDTH] < NARROW_ROW)
    if not peer and (kernel.any() or int((~kernel).sum()) > MANY_COPIES):
        kernel[:] = True
    if "triton" not in names:
        kernel[:] = False
    elif "driver" not in names:
        kernel[:] = True
    parts = (("triton", kernel), ("driver", ~kernel))
    return [(name, CopyPlan(c[mine])) for name, mine in parts if mine.any()]


def executors(plan: CopyPlan, base: torch.Tensor, peer: bool, what: str) -> tuple[CopyExecutor, ...]:
    """The executors :func:`assign_executors` picks, each built for its share of ``plan`` from ``base``."""
    return tuple(COPY_EXECUTORS[name](part, base, what) for name, part in assign_executors(plan, peer))
