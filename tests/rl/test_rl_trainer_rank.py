"""The RL loop's trainer -> driver hop without vLLM (the CPU twin of ``kvmove.rl.trainer_rank``): trainer rank 0
calls vLLM's four weight-sync calls on ``RemoteEngines``; they cross kvmove's control wire to the driver, where
``answer_engine_call`` runs them on the engines (here two reference-engine replicas that register by address,
as vLLM workers do). Every sync is checked bit-exact; a call outside vLLM's four is refused in one line."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pytest
import torch

from kvmove.engines import get_engine
from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout
from kvmove.models import resolve_model
from kvmove.rl.trainer_rank import EngineCall, RemoteEngines, answer_engine_call
from kvmove.sync.embedded.member import FleetMember, JoinInfo, Seat
from kvmove.sync.embedded.trainer import EmbeddedTrainer, TrainerSettings
from kvmove.sync.planning.plan import plan_rank
from kvmove.sync.ranks.wire import ControlClient, ControlServer
from kvmove.sync.strategies import parse_strategies
from kvmove.sync.verify import bits_equal, seeded_checkpoint

MODEL = "qwen3-tiny"


class Meta(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class DictSource:
    """vLLM's WeightSource shape over a dict the test steps in place."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def metadata(self) -> list[Meta]:
        return [Meta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()


class DriverEngines:
    """The driver's engines: two reference-engine replicas, each joining by address at init."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.adapter, self.layout = cfg, get_engine("reference"), EngineLayout()
        self.models = [self.adapter.build(cfg, self.layout, self.layout.coord(0)) for _ in range(2)]
        self.members: list[FleetMember] = []
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        plan = plan_rank(self.cfg, self.layout, self.layout.coord(0), engine=self.adapter)
        join = JoinInfo(**init_info)
        self.members = [FleetMember(join, Seat(f"r{i}"), self.cfg, m, plan) for i, m in enumerate(self.models)]

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        (strategy,) = parse_strategies(update_info["strategy"])
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(m.run, update_info["sync_id"], strategy) for m in self.members]:
                f.result()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")

    def mismatches(self, weights: dict[str, torch.Tensor]) -> list[str]:
        ref = self.adapter.build(self.cfg, self.layout, self.layout.coord(0))
        self.adapter.load_weights(ref, weights.items())
        want = dict(ref.named_parameters())
        return [n for m in self.models for n, p in m.named_parameters() if not bits_equal(p.data, want[n].data)]


def test_trainer_rank_0_drives_the_drivers_engines_over_the_control_wire() -> None:
    cfg = resolve_model(MODEL)
    engines, authkey = DriverEngines(cfg), secrets.token_bytes(32)
    server = ControlServer(lambda command: answer_engine_call(engines, command), "127.0.0.1", authkey)
    weights = dict(seeded_checkpoint(cfg, 1, 1))
    trainer = EmbeddedTrainer(0, DictSource(weights), RemoteEngines(server.address, authkey, 60), TrainerSettings())
    try:
        for version in (2, 3):
            weights.update(seeded_checkpoint(cfg, 1, version))
            trainer.sync(weight_version=str(version))
            assert engines.mismatches(weights) == [], f"version {version}"
        assert engines.calls == ["start", "finish 2", "start", "finish 3"]
        client = ControlClient(server.address, authkey, "driver", 30)
        try:
            with pytest.raises(KvmoveError, match="the RL driver's engines answer"):
                client.call(EngineCall("shutdown_weight_transfer_engine"))
        finally:
            client.close()
    finally:
        trainer.close()
        for m in engines.members:
            m.close()
        server.close()
