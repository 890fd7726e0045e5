"""Real syncs of BF16 trainers into FP8 engines (processes launcher, no Ray): every strategy lands FP8 weights and
scales bit-exact with the engine's own loader on the quantized full checkpoint, and moves the bytes the dry run
plans (FP8 where the trainer quantizes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmove.models import resolve_model
from kvmove.models.checkpoint import with_engine_dtype
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.dryrun import dry_run_sync
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.strategies import parse_strategies
from kvmove.transport import available_transports


@pytest.mark.parametrize(
    ("model", "trainer", "engine"),
    [
        ("qwen3-moe-fp8-tiny", "tp=4,etp=4", "tp=2"),  # k/v rows, MLP and expert widths cut mid-block: engine-side
        ("deepseek-v3-fp8-tiny", "tp=2,ep=2", "tp=2,ep=2"),  # whole blocks in every shard: trainer-side
    ],
)
def test_fp8_engines_sync_every_strategy_bit_exact(model: str, trainer: str, engine: str) -> None:
    config = SyncConfig(
        model=resolve_model(model),  # the preset's quantization_config: an FP8 engine
        trainer=TrainerLayout.parse(trainer),
        engine=EngineLayout.parse(engine),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        transport="nixl" if "nixl" in available_transports() else "gloo",
        verify=True,
        placement=Placement(launcher="processes"),
        deadline_s=90.0,
    )
    assert config.model.engine_dtype == "fp8"
    results = list(run_syncs(config))
    assert [r.strategy for r in results] == ["v1", "v2", "v3", "broadcast"]
    assert all(r.verified and r.live_engines == config.engine.world for r in results), results
    planned = {r.strategy: r.bytes_total for r in dry_run_sync(config)}
    bf16 = {
        r.strategy: r.bytes_total for r in dry_run_sync(replace(config, model=with_engine_dtype(config.model, "bf16")))
    }
    for r in results:  # packed pulls carry their parts at 16-byte offsets: a few bytes of padding on top of the plan
        assert planned[r.strategy] <= r.bytes < min(1.01 * planned[r.strategy], bf16[r.strategy]), r


@pytest.mark.gpu
def test_fp8_sync_on_one_gpu_quantizes_there() -> None:
    """Trainer and engine process on cuda:0 (the gpu-fp8 suite's one-GPU case), cuda-ipc, v3:
    quantization runs on the device (Triton where installed), every sync verified."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = SyncConfig(
        model=resolve_model("qwen3-moe-fp8-tiny"),
        trainer=TrainerLayout(),
        engine=EngineLayout(),
        strategies=tuple(parse_strategies("v3")),
        transport="cuda-ipc",
        syncs=2,
        verify=True,
        placement=Placement("processes", ("cuda:0",), ("cuda:0",)),
        deadline_s=90.0,
    )
    results = list(run_syncs(config))
    assert len(results) == 2 and all(r.verified for r in results), results
