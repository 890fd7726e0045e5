"""A sync run from inside a framework's processes (kvmove.sync.embedded), on the reference engine (no vLLM).

The CPU twin of kvmove's vLLM trainer engine: the trainer hosts its rank in this process over a re-iterable
``(name, tensor)`` source shaped like vLLM's ``WeightSource``; the "engine client" stands in for vLLM's four
calls: its init hands the join info to two engine replicas, each of which registers the plan of its own loader
by address (``FleetMember``), and its update pulls into both at once. Every sync is checked bit-exact against
the reference engine's loader fed the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pytest
import torch

from kvmove.engines import get_engine
from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout
from kvmove.models import resolve_model
from kvmove.models.tensors import hf_tensors
from kvmove.sync.embedded.member import FleetMember, JoinInfo, Seat
from kvmove.sync.embedded.trainer import EmbeddedTrainer, TrainerSettings
from kvmove.sync.planning.plan import plan_rank
from kvmove.sync.strategies import parse_strategies
from kvmove.sync.verify import bits_equal, seeded_checkpoint

MODEL = "qwen3-tiny"


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


@pytest.mark.parametrize("strategy", ["v1", "v3"])
def test_three_syncs_from_the_framework_process_are_bit_exact(strategy: str) -> None:
    cfg = resolve_model(MODEL)
    engines = Engines(cfg)
    weights = dict(seeded_checkpoint(cfg, 1, 1))
    source = DictSource(weights)
    trainer = EmbeddedTrainer(0, source, engines, TrainerSettings(strategy=strategy))
    try:
        assert trainer.fleet.layout.replicas == 2
        for version in (2, 3, 4):
            weights.update(seeded_checkpoint(cfg, 1, version))  # a training step, in place
            stats = trainer.sync(weight_version=str(version))
            assert stats.bytes_served > 0
            assert engines.mismatches(weights) == [], f"sync to version {version}"
        steps = [["start", "update", f"finish {v}"] for v in (2, 3, 4)]
        assert engines.calls == [call for step in steps for call in step]
    finally:
        trainer.close()
        engines.close()


def test_a_transport_engines_cannot_open_alone_is_refused() -> None:
    cfg = resolve_model(MODEL)
    source = DictSource(dict(seeded_checkpoint(cfg, 1, 1)))
    with pytest.raises(KvmoveError, match=r"'gloo' needs one fixed group"):
        EmbeddedTrainer(0, source, Engines(cfg), TrainerSettings(transport="gloo"))


def test_a_source_that_does_not_match_the_engines_model_is_refused() -> None:
    cfg = resolve_model(MODEL)
    weights = dict(seeded_checkpoint(cfg, 1, 1))
    missing = next(t.name for t in hf_tensors(cfg))
    del weights[missing]
    engines = Engines(cfg)
    try:
        with pytest.raises(KvmoveError, match=f"does not match the engines' model: missing {missing}"):
            EmbeddedTrainer(0, DictSource(weights), engines, TrainerSettings())
    finally:
        engines.close()


def test_an_engine_side_that_registers_nothing_is_a_clear_error() -> None:
    cfg = resolve_model(MODEL)
    engines = Engines(cfg, replicas=0)
    with pytest.raises(KvmoveError, match="no engine rank registered"):
        EmbeddedTrainer(0, DictSource(dict(seeded_checkpoint(cfg, 1, 1))), engines, TrainerSettings())
