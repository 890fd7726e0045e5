"""A real FSDP2 trainer (2 processes, CPU gloo) as the weight source: every strategy synced into the reference
engine after real optimizer steps, verified against the checkpoint the trainer saved itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.weights import saved_checkpoint
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.faults import FaultHooks
from kvmove.sync.driver.run import start
from kvmove.sync.driver.step import run_sync
from kvmove.sync.strategies import parse_strategies
from kvmove.sync.verify import bits_equal

pytest.importorskip("transformers", reason="the FSDP2 trainer builds transformers models (kvmove[train])")


def _config(tmp: Path, model: str = "qwen3-moe-tiny", **kw: object) -> SyncConfig:
    from kvmove.sync.sources.tiny_trainer import TinyFsdpTrainer

    base: dict[str, object] = dict(
        model=resolve_model(model),
        trainer=TrainerLayout(dp=2),
        engine=EngineLayout.parse("tp=2"),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        transport="gloo",
        verify=True,
        source=TinyFsdpTrainer(save_dir=str(tmp)),
        reference=str(tmp / "step-{version}"),
        placement=Placement(launcher="processes"),
        deadline_s=120.0,
    )
    base.update(kw)
    return SyncConfig(**base)  # type: ignore[arg-type]


def _run(config: SyncConfig) -> tuple[list, dict[str, int]]:
    cluster = start(config)
    try:
        direct = {s.name: cluster.blueprint.direct_bytes(s.name) for s in config.strategies}
        hooks = FaultHooks((), config.engine)
        results = [run_sync(cluster, hooks, s, 1, i) for i, s in enumerate(config.strategies, start=1)]
    finally:
        cluster.close()
    return results, direct


def test_fsdp_trainer_every_strategy_verified_against_its_own_checkpoint(tmp_path: Path) -> None:
    config = _config(tmp_path)
    results, direct = _run(config)
    assert [r.strategy for r in results] == ["v1", "v2", "v3", "broadcast"]
    for r in results:
        assert r.verified is True and r.live_engines == 2, (r.strategy, r.mismatches, r.notes)
    assert direct["v2"] > 0 and direct["v3"] > 0  # regions inside one rank's FSDP shard are read from its arena
    assert direct["v1"] == 0
    # every sync followed a real optimizer step: the saved weights change from step to step
    cfg = config.model
    steps = [saved_checkpoint(cfg, str(tmp_path / f"step-{v}")) for v in (1, 2, 3, 4)]
    for name in ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert not bits_equal(steps[0][name], steps[1][name])
        assert not bits_equal(steps[2][name], steps[3][name])


@pytest.mark.slow
def test_fsdp_fp32_masters_at_an_rl_learning_rate_sync_as_deltas(tmp_path: Path) -> None:
    """Mixed precision as RL trainers run it (FP32 masters, BF16 compute and image), AdamW at 1e-6: after the first
    (dense) sync each delta sync changes a few percent of the words and the first moves a few percent of the bytes,
    every sync verified against the saved image. Later ones may send a pull dense where its last delta measured
    slower, trainer and link together (``kvmove.sync.delta.detect.Costs.verdict``: on loopback a dense read is
    cheap, so which pulls go dense by cost depends on timing)."""
    from kvmove.sync.driver.run import run_syncs
    from kvmove.sync.sources.tiny_trainer import TinyFsdpTrainer

    trainer = TinyFsdpTrainer(save_dir=str(tmp_path), lr=1e-6, master=True)
    config = _config(tmp_path, strategies=tuple(parse_strategies("v3")), syncs=3, delta=True, source=trainer)
    results = list(run_syncs(config))
    assert all(r.verified for r in results), [(r.sync, r.mismatches[:3]) for r in results]
    first, *deltas = results
    assert first.delta["ratio"] == 1.0
    assert deltas[0].delta["ratio"] < 0.2 and deltas[0].delta["dense_by_cost"] == 0, deltas[0].delta  # none judged yet
    for r in deltas:
        assert 0 < r.delta["changed_fraction_all"] < 0.1, r.delta
        assert r.delta["ratio"] < 0.2 or r.delta["dense_by_cost"] > 0, r.delta  # dense only where a delta cost more
    assert saved_checkpoint(config.model, str(tmp_path / "step-2"))["model.norm.weight"].dtype == torch.bfloat16


def test_fsdp_with_tensor_parallel_mlps_on_a_2d_mesh(tmp_path: Path) -> None:
    # 4 trainer ranks as (dp=2, tp=2): MLP weights are TP DTensors sharded again by FSDP2 (_StridedShard on dp)
    from kvmove.sync.sources.tiny_trainer import TinyFsdpTrainer

    config = _config(
        tmp_path,
        "qwen3-tiny",
        trainer=TrainerLayout(dp=4),
        strategies=tuple(parse_strategies("v1,v3")),
        source=TinyFsdpTrainer(save_dir=str(tmp_path), tp=2),
    )
    results, direct = _run(config)
    assert all(r.verified is True for r in results), [(r.strategy, r.mismatches) for r in results]
    assert direct["v3"] > 0


def test_verification_uses_the_trainers_checkpoint(tmp_path: Path) -> None:
    # the same run verified against the seeded checkpoint instead: the trained weights are not those
    config = _config(tmp_path, strategies=tuple(parse_strategies("v2")), reference=None)
    results, _ = _run(config)
    assert results[0].verified is False and results[0].mismatches


def test_saved_checkpoint_refuses_a_foreign_one(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(KvmoveError, match=r"lacks|not in the model|is \("):
        saved_checkpoint(resolve_model("qwen3-moe-tiny"), str(tmp_path))
    with pytest.raises(KvmoveError, match=r"no \*\.safetensors"):
        saved_checkpoint(resolve_model("qwen3-moe-tiny"), str(tmp_path / "empty"))
