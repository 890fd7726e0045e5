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
from kvmove.sync.ranks.puller import MAPPED_EXECUTOR
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


def _mapped_path_taken(config: SyncConfig, results: list) -> None:
    """Every sync verified, and its FP8 bytes quantized by the engine from the mapped arena, none through a slot:
    what the transport read is the plain entries' bytes only."""
    (report,) = dry_run_sync(replace(config, verify=False))  # the plan only: the syncs verified
    by_transform = report.bytes_by_transform
    assert set(by_transform) == {"plain", "trainer"}
    for r in results:
        assert r.verified, r
        assert r.copy_executors.pop(MAPPED_EXECUTOR) == by_transform["trainer"], r.copy_executors
        assert sum(r.copy_executors.values()) == by_transform["plain"], r.copy_executors


@pytest.mark.slow  # two processes of their own (~45 s here); tests/sync/ranks/test_engine_mapped.py is its fast twin
def test_fp8_sync_quantizes_from_the_trainers_mapped_arena_bit_exact() -> None:
    """The CPU twin of the one-GPU case: trainer and engine ranks in processes of their own sharing a device
    (colocated), over shm, whose engine maps the trainer's arena as cuda-ipc does: the engine quantizes every FP8
    cover from it straight into its parameters (mapped pulls), warm from init, every sync verified bit-exact."""
    config = SyncConfig(
        model=resolve_model("qwen3-moe-fp8-tiny"),
        trainer=TrainerLayout(),
        engine=EngineLayout(),
        strategies=tuple(parse_strategies("v3")),
        transport="shm",
        syncs=2,
        verify=True,
        placement=Placement(launcher="processes", colocated=True),
        deadline_s=90.0,
    )
    _mapped_path_taken(config, list(run_syncs(config)))


@pytest.mark.gpu
def test_fp8_sync_on_one_gpu_quantizes_there() -> None:
    """Trainer and engine process on cuda:0 (the gpu-fp8 suite's one-GPU case), cuda-ipc, v3: the engine
    quantizes every FP8 cover from the trainer's mapped arena into its parameters (Triton where installed), every
    sync verified."""
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
    assert len(results) == 2
    _mapped_path_taken(config, results)
