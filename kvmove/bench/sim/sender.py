"""Costs of a broadcast's sender from its rows: the sending rank's broadcast calls, the gather onto it (kvmove's
own broadcast between several trainer ranks) and, between CPU processes, the rate of gloo's broadcast.

Extractors of ``kvmove.bench.sim.measure`` (its ``EXTRACTORS`` name them); they read the book being built through
that module (``measure._median``), so a cost they subtract is the one the book holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pandas as pd

from kvmove.bench.sim.counts import row_counts
from kvmove.bench.sim.hardware import NICS, Cluster, rounds
from kvmove.bench.sim.samples import Sample, row_ref, syncs
from kvmove.errors import KvmoveError
from kvmove.models.layout import TrainerLayout, split_label
from kvmove.sync.ranks.calltimes import CallTimes, Line


class Rates(NamedTuple):
    """What kvmove.bench.sim.measure knows of the rows, handed to these extractors (they are its entries): a
    row's line rate (GB/s), a cost's median over the rows and the bounds a cost is clipped to."""

    line_gbps: Callable[[Any], float]
    median: Callable[[pd.DataFrame, str], float]
    clip: Callable[[str, float], float]


def broadcast_op(df: pd.DataFrame, m: Rates) -> list[Sample]:
    """Broadcast syncs, per step of a send: the fixed term of the line through the root's own sends (one per
    tensor, ``send_line``), or, for rows that carry none, (the root's time in its sends - its bytes at the
    broadcast rate) / steps. Trainer rank 0 alone broadcasts and times its sends
    (``kvmove.sync.ranks.broadcast.send_all``: the ``trainer_wait`` phase of a broadcast row); a step is one NCCL
    call, or one round of gloo's binomial tree between CPU processes, whose root sends its bytes once per round
    (``hardware.ROUNDS``)."""
    out = []
    for _, r in syncs(df, None, ("broadcast",)).iterrows():
        counts = row_counts(r)
        send = float(r["phases_d"].get("trainer_wait", 0.0))
        engines = int(r["extra_d"].get("live_engines") or 0)
        if counts is None or send <= 0 or engines < 1:
            continue
        steps = rounds(_row_cluster(r), -(1 + engines))
        line = send_line(r)
        if line is not None:
            out.append(Sample(line.fixed / steps, row_ref(r)))
            continue
        rate = m.line_gbps(r) * 1e9 * m.median(df, "nccl_efficiency")
        out.append(Sample((send - steps * r["bytes"] / engines / rate) / (counts.tensors * steps), row_ref(r)))
    return out


def send_line(r: Any) -> Line | None:
    """The least-squares line through a broadcast row's root sends (``extra.broadcast_calls``), None for rows
    recorded before sends were timed one by one, or whose sends give no line (``CallTimes.fit``)."""
    sums = r["extra_d"].get("broadcast_calls") or {}
    return CallTimes(**sums).fit() if sums else None


def raw_broadcast(df: pd.DataFrame) -> list[Sample]:
    """CPU sync rows, the bytes the broadcast's root sent per second per round of gloo's tree (``hardware.ROUNDS``)
    over the run's raw read: from the per-byte term of the line through the sync's own sends (``send_line``), or,
    for rows that carry none, from the raw gloo broadcast their run timed to its engine group
    (``kvmove.bench.rawcast``, 64 MiB)."""
    out = []
    for _, r in syncs(df, None, ("broadcast",)).iterrows():
        e, line_gbps = r["extra_d"], r["gpu"].nvlink_gbps
        line, engines = send_line(r), int(e.get("live_engines") or 0)
        gbps, members = float(e.get("raw_broadcast_gbps") or 0.0), int(e.get("raw_broadcast_members") or 0)
        if line is not None and engines > 0 and line_gbps > 0:
            steps = rounds(_row_cluster(r), -(1 + engines))
            out.append(Sample(steps / line.per_byte / 1e9 / line_gbps, row_ref(r)))
        elif gbps > 0 and members > 1 and line_gbps > 0:
            out.append(Sample(rounds(_row_cluster(r), -members) * gbps / line_gbps, row_ref(r)))
    return out


def _row_cluster(r: Any) -> Cluster:
    """The devices a row ran on, as the pricing sees them (a CPU host's processes, or its GPUs)."""
    return Cluster(r["gpu"], NICS["cx7-400"], max(2, _world(r)), 1)


def _world(r: Any) -> int:
    try:
        return TrainerLayout.parse(str(r["trainer"])).world
    except KvmoveError:
        return 1


def funnel_yield(df: pd.DataFrame, m: Rates) -> list[Sample]:
    """kvmove's broadcast with several trainer ranks: every rank visits every tensor and rank 0 waits for each to
    be gathered and brought to it before broadcasting it (``kvmove.sync.ranks.broadcast.send_all``). What the
    sync takes besides the driver (``sync_s``), rank 0's broadcast calls (``trainer_wait``), the engines' load and
    the gather's collectives and bytes (the simulator's gather phase of the row's own setup, at this book's
    ``broadcast_op_s`` and rate), per tensor."""
    from kvmove.bench.sim.costs import Cost, default_book
    from kvmove.bench.sim.predict import simulate
    from kvmove.bench.sim.setup import Spec
    from kvmove.bench.sim.strategies import SIM_STRATEGIES

    out = []
    rows = syncs(df, None, ("broadcast",))
    for _, r in rows[rows.apply(lambda r: _world(r) > 1, axis=1)].iterrows() if len(rows) else ():
        counts = row_counts(r)
        p = r["phases_d"]
        if counts is None:
            continue
        layout, reps = split_label(r["engine"])
        cluster = _row_cluster(r).spec()
        spec = Spec(str(r["model"]), str(r["trainer"]), layout, reps, 1, 1, cluster, "colocated", "nccl")
        names = ("broadcast_op_s", "nccl_efficiency")
        known = {name: Cost(name, m.clip(name, m.median(df, name)), "derived") for name in names}
        book = default_book({**known, "materialize_s": Cost("materialize_s", 0.0, "derived")})
        try:
            (pred,) = simulate(spec.build(), [SIM_STRATEGIES["broadcast"]], book)
        except KvmoveError:
            continue
        rest = float(r["seconds"]) - m.median(df, "sync_s") - float(p.get("trainer_wait", 0.0))
        rest -= float(p.get("load", 0.0)) + pred.phases["gather"]
        out.append(Sample(rest / counts.tensors, row_ref(r)))
    return out
