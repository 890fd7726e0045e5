"""kvmove through vLLM's RL docs alone: ``weight_transfer_config={"backend": "kvmove"}`` on the inference side,
``WeightTransferTrainerFactory.trainer_init`` + ``send_weights()`` on the trainer side, nothing else.

The engines run in vLLM's default multi-process mode (the worker in the engine core's own process, not this one)
and as an ``AsyncLLM`` with generation kept across the update (``pause_generation(mode="keep")``). The trainer's
source is vLLM's ``ModuleSource`` over a transformers model. Three updates each: after every one, what the
worker computes with is checked bit-exact (in the worker, through ``collective_rpc``) against vLLM's own loader
fed the seeded checkpoint the trainer stepped to, and generation is checked: it changes with the weights, and
returns exactly to the first output when the first weights come back. Needs vLLM (``make test-vllm``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

MODEL = "qwen2-vllm"
SEED = 5
PROMPTS = [[3, 17, 42, 7, 99, 5], [200, 1, 150, 60, 61, 62, 63, 64]]
TOKENS = 6
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the test's bit-exact check runs in the worker (collective_rpc)
}


def _vllm_or_skip() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("KVMOVE_REQUIRE_VLLM") == "1":
            pytest.fail("KVMOVE_REQUIRE_VLLM=1 but vLLM is not installed (make test-vllm installs it)")
        pytest.skip("vLLM is not installed (make test-vllm runs these tests)")


def worker_pid(_worker: Any) -> int:
    return os.getpid()


class Trainer:
    """The trainer process's model (transformers, bf16) and the three checkpoints it steps through."""

    def __init__(self) -> None:
        import transformers

        from kvmove.models import resolve_model
        from kvmove.models.directory import hf_config
        from kvmove.models.weights import seeded_checkpoint

        self.cfg = resolve_model(MODEL)
        config = transformers.AutoConfig.for_model(**hf_config(self.cfg))
        self.model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        self.versions = {v: seeded_checkpoint(self.cfg, SEED, v) for v in (1, 2, 3)}

    def step(self, version: int) -> dict[str, torch.Tensor]:
        """A training step: the model now holds the weights of ``version``."""
        weights = self.versions[version]
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(weights[name])
        return weights


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Trainer, Path]]:
    _vllm_or_skip()
    from kvmove.models.directory import write_model_dir

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # vLLM's default: multi-process
    trainer = Trainer()
    yield trainer, write_model_dir(trainer.cfg, tmp_path / "model", trainer.versions[1])


def _trainer_engine(trainer: Trainer, client: Any, source: Any = None) -> Any:
    """vLLM's trainer side, as its docs write it (backend selected by the init info's class); the source is
    vLLM's ``ModuleSource`` over the trainer's model unless given."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from kvmove.vllm.trainer import KvmoveTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        init_info=KvmoveTrainerInitInfo(rank=0, strategy="v3", transport="nixl"),
        client=client,
        source=source if source is not None else ModuleSource(trainer.model),
    )


def _greedy() -> Any:
    import vllm

    return vllm.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


def test_llm_in_the_default_multiprocess_engine_three_verified_updates(setup: tuple[Trainer, Path]) -> None:
    import vllm

    from kvmove.vllm.clients import LLMClient
    from kvmove.vllm.rpc import verify_worker

    trainer, model_dir = setup
    llm = vllm.LLM(
        model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
        weight_transfer_config={"backend": "kvmove"},
    )  # fmt: skip
    try:
        assert llm.collective_rpc(worker_pid) != [os.getpid()]  # the worker pulls from another process

        def generate() -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        first = generate()
        engine = _trainer_engine(trainer, LLMClient(llm))
        outputs = []
        for version in (2, 3, 1):
            trainer.step(version)
            engine.send_weights(weight_version=str(version))
            assert llm.collective_rpc(verify_worker, args=(SEED, version)) == [[]], f"version {version} differs"
            assert llm.get_weight_version() == str(version)
            outputs.append(generate())
        assert outputs[0] != first and outputs[1] not in (first, outputs[0])  # the weights changed the output
        assert outputs[2] == first  # the first weights back: exactly the first output
        engine.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.llm_engine.engine_core.shutdown()


class LoopThread:
    """An asyncio loop in its own thread: the AsyncLLM lives there; the trainer calls from this thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _generate(engine: Any, prompt: list[int], request_id: str, tokens: int = TOKENS) -> list[int]:
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    final: Any = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        final = out
    return list(final.outputs[0].token_ids)


def test_async_llm_keeps_generation_across_three_verified_updates(setup: tuple[Trainer, Path]) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvmove.vllm.clients import AsyncLLMClient
    from kvmove.vllm.rpc import verify_worker

    trainer, model_dir = setup
    loop = LoopThread()
    args = AsyncEngineArgs(
        model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
        weight_transfer_config={"backend": "kvmove"},
    )  # fmt: skip

    async def start() -> Any:
        return AsyncLLM.from_engine_args(args)

    llm = loop.run(start())
    try:
        first = [loop.run(_generate(llm, p, f"first-{i}")) for i, p in enumerate(PROMPTS)]
        engine = _trainer_engine(trainer, AsyncLLMClient(llm, loop.loop))
        outputs = []
        for version in (2, 3, 1):
            trainer.step(version)
            kept = asyncio.run_coroutine_threadsafe(_generate(llm, PROMPTS[0], f"kept-{version}", 64), loop.loop)
            loop.run(llm.pause_generation(mode="keep"))
            engine.send_weights(weight_version=str(version))
            loop.run(llm.resume_generation())
            assert len(kept.result(300)) == 64  # the request kept across the update finished
            assert loop.run(llm.collective_rpc(verify_worker, args=(SEED, version))) == [[]], f"version {version}"
            outputs.append([loop.run(_generate(llm, p, f"v{version}-{i}")) for i, p in enumerate(PROMPTS)])
        assert outputs[0] != first and outputs[1] not in (first, outputs[0])
        assert outputs[2] == first
        engine.shutdown()
        loop.run(llm.shutdown_weight_transfer_engine())
    finally:
        llm.shutdown()
        loop.stop()


def test_llm_with_two_tensor_parallel_workers_on_cpu(
    setup: tuple[Trainer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # tensor_parallel_size=2 on CPU: vLLM's automatic OpenMP binding wants one NUMA node per worker, so each worker
    # is bound to one core by hand; the two workers share a replica key and each pulls its own shards
    import vllm

    from kvmove.vllm.clients import LLMClient
    from kvmove.vllm.rpc import verify_worker

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two tensor-parallel CPU workers need two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2]))
    trainer, model_dir = setup
    llm = vllm.LLM(
        model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
        tensor_parallel_size=2, weight_transfer_config={"backend": "kvmove"},
    )  # fmt: skip
    try:

        def generate() -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        first = generate()
        engine = _trainer_engine(trainer, LLMClient(llm))
        assert engine.trainer.fleet.layout.tp == 2 and engine.trainer.fleet.layout.replicas == 1
        for version in (2, 1):
            trainer.step(version)
            engine.send_weights(weight_version=str(version))
            assert llm.collective_rpc(verify_worker, args=(SEED, version)) == [[], []], f"version {version}"
            assert (generate() == first) is (version == 1)
        engine.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.llm_engine.engine_core.shutdown()
