"""Pull counting: one pull per engine rank, kind and serving trainer rank, as the planner buckets them."""

from __future__ import annotations

import numpy as np

from kvmove.bench.sim.pulls import by_rank, count_pulls


def test_direct_reads_are_one_pull_per_serving_trainer_rank() -> None:
    pairs = {
        (0, ("shard", (0,))),  # a TP shard on trainer rank 0
        (0, ("shard", (1,))),  # the other shard, on rank 1
        (0, ("shard", (0, 1))),  # a replicated tensor: either rank serves it, no third pull
        (1, ("shard", (2, 3))),  # engine rank 1 reads a replicated tensor only: spread over both holders
        (0, ("from", None, (0, 1), False)),  # a packed pull, served by one of the gathered holders
    }
    got = sorted(by_rank(pairs))
    assert got == [(0, "from", (0, 1)), (0, "shard", (0,)), (0, "shard", (1,)), (1, "shard", (2,)), (1, "shard", (3,))]


def test_counts_land_per_group_and_a_packed_call_is_shared_by_its_holders() -> None:
    sources = [{(0, ("shard", (0,))), (0, ("from", None, (0, 1), False))}, {(1, ("shard", (1,)))}]
    pulls, direct, calls = np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2))
    count_pulls(sources, pulls, direct, calls)
    assert pulls.tolist() == [[2, 0], [0, 1]] and direct.tolist() == [[1, 0], [0, 1]]
    assert calls.tolist() == [[0.5, 0.5], [0, 0]]
