"""The rule that splits a CUDA copy batch between the copy engine and the Triton kernel (pure: no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmove.transport.base import TransportError
from kvmove.transport.copies import CopyPlan
from kvmove.transport.executors import COPY_EXECUTORS, MANY_COPIES, NARROW_ROW, assign_executors

BOTH = frozenset({"driver", "triton"})


def _plan(rows: list[list[int]]) -> CopyPlan:
    return CopyPlan(np.array(rows, dtype=np.int64).reshape(-1, 6))


NARROW = [0, 0, 1536, 4096, 3072, 1536]  # a row-parallel half of a down projection
WIDE_2D = [1 << 24, 1 << 24, NARROW_ROW, 4096, 2 * NARROW_ROW, NARROW_ROW]
BIG = [1 << 30, 1 << 30, 1 << 30, 1, 1 << 30, 1 << 30]


def _names(plan: CopyPlan, peer: bool = False, available: frozenset[str] = BOTH) -> list[tuple[str, int]]:
    return [(name, part.ncopies) for name, part in assign_executors(plan, peer, available)]


def test_narrow_rows_go_to_the_kernel_and_big_copies_to_the_copy_engine() -> None:
    plan = _plan([NARROW, WIDE_2D, BIG])
    assert _names(plan, peer=True) == [("triton", 1), ("driver", 2)]
    assert _names(plan) == [("triton", 3)]  # inside one GPU the two shares would run one after the other
    assert _names(_plan([WIDE_2D, BIG])) == [("driver", 2)]  # nothing narrow: the copy engine
    parts = assign_executors(plan, True, BOTH)
    assert sum(p.nbytes for _, p in parts) == plan.nbytes


def test_many_copies_inside_one_gpu_go_to_the_kernel_whole() -> None:
    many = _plan([[i * 64, i * 64, 64, 1, 64, 64] for i in range(MANY_COPIES + 1)] + [NARROW])
    assert _names(many) == [("triton", MANY_COPIES + 2)]
    assert _names(many, peer=True) == [("triton", 1), ("driver", MANY_COPIES + 1)]  # the link bounds a peer read
    few = _plan([[i * 64, i * 64, 64, 1, 64, 64] for i in range(MANY_COPIES)])
    assert _names(few) == [("driver", MANY_COPIES)]


def test_without_triton_everything_goes_to_the_driver_and_without_either_it_is_a_clear_error() -> None:
    plan = _plan([NARROW, BIG])
    assert _names(plan, available=frozenset({"driver"})) == [("driver", 2)]
    assert _names(plan, available=frozenset({"triton"})) == [("triton", 2)]
    with pytest.raises(TransportError, match="no CUDA copy executor"):
        assign_executors(plan, False, frozenset())


def test_an_empty_plan_needs_no_executor() -> None:
    assert assign_executors(_plan([]), False, BOTH) == []


def test_the_registry_names_its_executors() -> None:
    assert {name: cls.name for name, cls in COPY_EXECUTORS.items()} == {"driver": "driver", "triton": "triton"}
