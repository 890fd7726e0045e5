"""The Ray-free driver (torch.multiprocessing ranks), as the GPU machine runs it, here on CPU."""

from __future__ import annotations

import pytest

from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models import resolve_model
from kvmove.sync.local import LocalConfig, run_local
from kvmove.sync.strategies import parse_strategies


@pytest.mark.parametrize(
    ("transport", "trainer"), [("gloo", "tp=2,ep=2"), ("nccl", "tp=1"), ("nixl", "tp=2,pp=2,ep=2")]
)
def test_local_syncs_verify_without_ray(transport: str, trainer: str) -> None:
    from kvmove.transport import available_transports

    if transport == "nixl" and "nixl" not in available_transports():
        pytest.skip("nixl is not installed here")
    config = LocalConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse(trainer),
        engine=EngineLayout.parse("tp=2"),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        transport=transport,  # nccl runs its pull protocol over gloo on CPU
        deadline_s=60,
    )
    results = list(run_local(config))
    assert [r.strategy for r in results] == ["v1", "v2", "v3", "broadcast"]
    assert all(r.verified for r in results)
    assert len({r.bytes for r in results[:3]}) == 1 and results[3].bytes == 2 * 2 * 256_192


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc"])
@pytest.mark.parametrize("direct", [True, False])
def test_gpu_syncs_repeat_without_hanging(transport: str, direct: bool) -> None:
    """Regression: the nccl pull transport used to hang at the second sync (a receive posted on the GPU while
    waiting for the next request blocked the trainer's next device-synchronizing call)."""
    import torch

    from kvmove.sync.schedule import SyncOptions

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    config = LocalConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=1"),  # NOTE: NCCL refuses two ranks of one communicator on one GPU
        engine=EngineLayout.parse("tp=1"),
        strategies=tuple(parse_strategies("v2,v3")),
        transport=transport,
        syncs=3,
        options=SyncOptions(direct=direct),
        trainer_devices=("cuda:0",),
        engine_devices=("cuda:1",),
        deadline_s=60,
    )
    results = list(run_local(config))
    assert len(results) == 6 and all(r.verified for r in results)
