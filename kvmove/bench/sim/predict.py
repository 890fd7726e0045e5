"""The simulator's entry point: predictions for one setup and a list of strategies (traffic built once, cached)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from kvmove.bench.sim.builder import build_traffic
from kvmove.bench.sim.costs import CostBook
from kvmove.bench.sim.delta import apply_delta
from kvmove.bench.sim.mapped import mapping_key
from kvmove.bench.sim.pricing import Prediction, price
from kvmove.bench.sim.setup import SimSetup
from kvmove.bench.sim.strategies import SimStrategy
from kvmove.bench.sim.traffic import Traffic

_TRAFFIC: dict[tuple[object, ...], Traffic] = {}
_CACHE_LIMIT = 96


def traffic_for(s: SimSetup, strategy: SimStrategy) -> Traffic:
    """The traffic of ``strategy`` on ``s``, built once per process (it depends on no cost and on the topology only
    through where mapped pulls are planned: ``kvmove.bench.sim.mapped.mapping_key``); a delta sync's is the dense
    traffic with its changed fractions applied."""
    key = (
        s.model,
        s.trainer,
        s.engine,
        s.dtype,
        s.quantize_on,
        s.block,
        s.direct,
        s.via_host,
        s.group_size,
        s.bucket_bytes,
        s.ep_gather,
        mapping_key(s),
        strategy,
    )
    dense = _cached(key, lambda: build_traffic(s, strategy))
    return dense if s.delta is None else _cached((*key, s.delta), lambda: apply_delta(dense, s))


def _cached(key: tuple[object, ...], make: Callable[[], Traffic]) -> Traffic:
    if key not in _TRAFFIC:
        if len(_TRAFFIC) >= _CACHE_LIMIT:
            _TRAFFIC.pop(next(iter(_TRAFFIC)))
        _TRAFFIC[key] = make()
    return _TRAFFIC[key]


def simulate(s: SimSetup, strategies: Iterable[SimStrategy], book: CostBook) -> list[Prediction]:
    """One prediction per strategy."""
    out = []
    for strategy in strategies:
        totals = None
        if strategy.grouping == "tensor":
            totals = traffic_for(s, dataclasses.replace(strategy, grouping="layer", pipelined=False))
        out.append(price(traffic_for(s, strategy), s, book, totals))
    return out
