"""Pull counting: one pull per engine rank, kind and serving trainer rank, as the planner buckets and routes them."""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvmove.bench.sim.pulls import Source, by_rank, count_pulls


def test_an_engine_rank_pulls_once_from_each_rank_serving_it() -> None:
    jobs: Counter[Source] = Counter(
        {
            (0, ("shard", (0,))): 3,  # TP shards on trainer rank 0
            (0, ("shard", (1,))): 3,  # the other shards, on rank 1
            (0, ("shard", (0, 1))): 2,  # replicated tensors: ranks 0 and 1 already serve it, no third pull
            (1, ("shard", (2, 3))): 5,  # engine rank 1 reads replicated tensors only: spread over both holders
            (2, ("shard", (2, 3))): 1,  # one job: one pull, whichever holder serves it
            (0, ("from", None, (0, 1))): 1,  # one packed tensor gathered on ranks 0 and 1: one pull
            (1, ("from", None, (0, 1))): 4,  # four of them: spread over both
        }
    )
    got = sorted(by_rank(jobs))
    assert got == [
        (0, "from", 1, (0, 1)),
        (0, "shard", 2, (0, 1)),
        (1, "from", 2, (0, 1)),
        (1, "shard", 2, (2, 3)),
        (2, "shard", 1, (2, 3)),
    ]


def test_counts_land_per_group_and_packed_calls_spread_over_their_holders() -> None:
    sources: list[Counter[Source]] = [
        Counter({(0, ("shard", (0,))): 1, (0, ("from", None, (0, 1))): 1}),
        Counter({(1, ("shard", (1,))): 2}),
    ]
    pulls, direct, calls = np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2))
    count_pulls(sources, pulls, direct, calls)
    assert pulls.tolist() == [[2, 0], [0, 1]] and direct.tolist() == [[1, 0], [0, 1]]
    assert calls.tolist() == [[0.5, 0.5], [0, 0]]
