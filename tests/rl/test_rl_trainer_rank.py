"""The RL loop's trainer -> driver hop without vLLM (the CPU twin of ``kvmove.rl.trainer_rank``): trainer rank 0
calls vLLM's four weight-sync calls on ``RemoteEngines``; they cross kvmove's control wire to the driver, where
``answer_engine_call`` runs them on the engines (here two reference-engine replicas that register by address,
as vLLM workers do). Every sync is checked bit-exact; a call outside vLLM's four is refused in one line."""

from __future__ import annotations

import secrets

import pytest
from embedded_engines import DictSource, Engines

from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.rl.trainer_rank import EngineCall, RemoteEngines, answer_engine_call
from kvmove.sync.embedded.trainer import EmbeddedTrainer, TrainerSettings
from kvmove.sync.ranks.wire import ControlClient, ControlServer

MODEL = "qwen3-tiny"


def test_trainer_rank_0_drives_the_drivers_engines_over_the_control_wire() -> None:
    cfg = resolve_model(MODEL)
    engines, authkey = Engines(cfg), secrets.token_bytes(32)
    server = ControlServer(lambda command: answer_engine_call(engines, command), "127.0.0.1", authkey)
    weights = dict(seeded_checkpoint(cfg, 1, 1))
    trainer = EmbeddedTrainer(0, DictSource(weights), RemoteEngines(server.address, authkey, 60), TrainerSettings())
    try:
        for version in (2, 3):
            weights.update(seeded_checkpoint(cfg, 1, version))
            trainer.sync(weight_version=str(version))
            assert engines.mismatches(weights) == [], f"version {version}"
        assert engines.calls == ["start", "update", "finish 2", "start", "update", "finish 3"]
        client = ControlClient(server.address, authkey, "driver", 30)
        try:
            with pytest.raises(KvmoveError, match="the RL driver's engines answer"):
                client.call(EngineCall("shutdown_weight_transfer_engine"))
        finally:
            client.close()
    finally:
        trainer.close()
        engines.close()
        server.close()
