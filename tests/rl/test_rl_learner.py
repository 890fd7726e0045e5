"""The RL loop's trainer ranks without an engine that generates: a real FSDP2 policy (2 processes, CPU gloo)
trained on rollouts handed to it through ``TrainStep``, each step synced into the reference engine and verified
against the checkpoint the policy saved; REINFORCE makes a sample with positive advantage likelier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmove.errors import KvmoveError
from kvmove.rl.rollouts import Rollouts, Sample

pytest.importorskip("transformers", reason="the FSDP2 policy is a transformers model (kvmove[train])")

GOOD, BAD = (5, 6, 7, 8), (9, 10, 11, 12)
PROMPT = (3, 4)


def _logprob(directory: Path, tokens: tuple[int, ...]) -> float:
    """log p(tokens | PROMPT) under the checkpoint the trainer saved in ``directory``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return float(sum(logp[len(PROMPT) - 1 + j, t] for j, t in enumerate(tokens)))


def test_the_policy_trains_on_rollouts_and_every_sync_verifies(tmp_path: Path) -> None:
    import dataclasses

    from kvmove.rl.loop import RlConfig, sync_config
    from kvmove.sync.driver.faults import FaultHooks
    from kvmove.sync.driver.run import start
    from kvmove.sync.driver.step import run_sync
    from kvmove.sync.ranks.control import TrainStep

    rl = RlConfig(model="qwen3-moe-tiny", engines=1, launcher="processes", transport="gloo")
    config = dataclasses.replace(sync_config(rl, tmp_path), engine_kind="reference")
    cluster = start(config)
    try:

        def update(version: int) -> bool | None:
            return run_sync(cluster, FaultHooks((), config.engine), config.strategies[0], version, version).verified

        assert update(1) is True
        # rank 0 gets samples 0 and 2, rank 1 samples 1 and 3: each rank sees a good and a bad sample
        samples = [Sample(PROMPT, GOOD, (0.0,) * 4, 1.0, 1.0), Sample(PROMPT, BAD, (0.0,) * 4, 0.0, -1.0)] * 2
        reports = cluster.launcher.call(cluster.trainers, TrainStep(Rollouts(tuple(samples))), 600)
        assert [r.rank for r in reports] == [0, 1] and all(r.samples == 2 and r.tokens == 8 for r in reports)
        assert all(r.logprob_gap > 0 for r in reports)  # the engine log-probs given here are 0: not the trainer's
        assert update(2) is True
        with pytest.raises(KvmoveError, match="trains on Rollouts, not str"):
            cluster.launcher.call(cluster.trainers, TrainStep("not rollouts"), 60)
    finally:
        cluster.close()
    before, after = tmp_path / "step-1", tmp_path / "step-2"
    assert _logprob(after, GOOD) > _logprob(before, GOOD)
    assert _logprob(after, BAD) < _logprob(before, BAD)


@pytest.mark.slow
def test_fp32_master_policy_syncs_as_deltas_verified(tmp_path: Path) -> None:
    """The RL policy with FP32 masters and a BF16 image at an RL learning rate: after a training step on
    rollouts, the delta sync moves a few percent of the dense bytes and verifies against the saved image."""
    import dataclasses

    from kvmove.rl.loop import RlConfig, sync_config
    from kvmove.sync.driver.faults import FaultHooks
    from kvmove.sync.driver.run import start
    from kvmove.sync.driver.step import run_sync
    from kvmove.sync.ranks.control import TrainStep

    rl = RlConfig(model="qwen3-moe-tiny", engines=1, launcher="processes", transport="gloo", lr=1e-6)
    rl = dataclasses.replace(rl, master=True, delta=True)
    config = dataclasses.replace(sync_config(rl, tmp_path), engine_kind="reference")
    cluster = start(config)
    try:
        hooks = FaultHooks((), config.engine)
        first = run_sync(cluster, hooks, config.strategies[0], 1, 1)
        samples = [Sample(PROMPT, GOOD, (0.0,) * 4, 1.0, 1.0), Sample(PROMPT, BAD, (0.0,) * 4, 0.0, -1.0)] * 2
        cluster.launcher.call(cluster.trainers, TrainStep(Rollouts(tuple(samples))), 600)
        second = run_sync(cluster, hooks, config.strategies[0], 2, 2)
    finally:
        cluster.close()
    assert first.verified is True and second.verified is True, second.mismatches
    assert first.delta["ratio"] == 1.0 and 0 < second.delta["ratio"] < 0.2, second.delta


def test_a_source_that_does_not_train_refuses_a_batch() -> None:
    from kvmove.sync.ranks.source import WeightSource

    class Frozen(WeightSource):
        def metadata(self):  # type: ignore[no-untyped-def]
            return []

        def shards(self):  # type: ignore[no-untyped-def]
            return {}

        def held_names(self, scope):  # type: ignore[no-untyped-def]
            return None

        def materialize(self, names, scope):  # type: ignore[no-untyped-def]
            return iter(())

    with pytest.raises(KvmoveError, match="Frozen does not train"):
        Frozen().train(Rollouts(()))
