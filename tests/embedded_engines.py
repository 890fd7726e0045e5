"""Test doubles for the embedded (vLLM-shaped) sync path, without vLLM: a ``WeightSource``-shaped dict and two
reference-engine replicas behind vLLM's four weight-sync calls, each joining by address as vLLM workers do.
Used by tests/sync/test_embedded.py and tests/rl/test_rl_trainer_rank.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from kvmove.engines import get_engine
from kvmove.models.layout import EngineLayout
from kvmove.sync.embedded.member import FleetMember, JoinInfo, Seat
from kvmove.sync.planning.plan import plan_rank
from kvmove.sync.strategies import parse_strategies
from kvmove.sync.verify import bits_equal


class Meta(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class DictSource:
    """vLLM's WeightSource shape: metadata() without data, a fresh (name, tensor) pass per iteration."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def metadata(self) -> list[Meta]:
        return [Meta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()


class Engines:
    """Two reference-engine replicas behind vLLM's four weight-sync calls."""

    def __init__(self, cfg: Any, replicas: int = 2) -> None:
        self.cfg, self.adapter = cfg, get_engine("reference")
        self.layout, self.replicas = EngineLayout(), replicas
        self.models = [self.adapter.build(cfg, self.layout, self.layout.coord(0)) for _ in range(replicas)]
        self.members: list[FleetMember] = []
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        join = JoinInfo(**init_info)
        plan = plan_rank(self.cfg, self.layout, self.layout.coord(0), engine=self.adapter)
        self.members = [FleetMember(join, Seat(f"replica-{i}"), self.cfg, m, plan) for i, m in enumerate(self.models)]

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        (strategy,) = parse_strategies(update_info["strategy"])
        with ThreadPoolExecutor(len(self.members)) as pool:
            for f in [pool.submit(m.run, update_info["sync_id"], strategy) for m in self.members]:
                f.result()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")

    def mismatches(self, weights: dict[str, torch.Tensor]) -> list[str]:
        ref = self.adapter.build(self.cfg, self.layout, self.layout.coord(0))
        self.adapter.load_weights(ref, weights.items())
        want = dict(ref.named_parameters())
        return [n for m in self.models for n, p in m.named_parameters() if not bits_equal(p.data, want[n].data)]

    def close(self) -> None:
        for m in self.members:
            m.close()
