"""The RL loop's inference side: live vLLM ``LLM`` engines in the driver, as an RL framework holds them.

Each engine is a plain ``vllm.LLM`` in vLLM's default multi-process mode, started with
``weight_transfer_config={"backend": "kvmove"}`` and nothing else of kvmove's: its worker (in the engine core's
own process) builds its puller from the init info the trainer sends (``kvmove.vllm.join``). The driver
serves vLLM's four weight-sync calls to trainer rank 0 (``kvmove.rl.trainer_rank.RemoteEngines``) and runs each
on every engine at once (``EngineGroup``); it checks every sync in the workers (``collective_rpc``) against the
checkpoint the trainer saved, and generates rollouts from the same ``LLM`` objects.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.directory import write_model_dir
from kvmove.rl.trainer_rank import answer_engine_call
from kvmove.sync.ranks.control import Address, Completion, EngineStats, Sampling
from kvmove.sync.ranks.wire import ControlServer
from kvmove.vllm import BACKEND, import_vllm
from kvmove.vllm.actor import ENV, MAX_MODEL_LEN

ENGINE_SHUTDOWN_S = 30.0
"""How long an engine core may take to stop. vLLM's default (5 s) is no longer than the core's own grace for its
worker (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, 5 s, then SIGTERM and 4 s more): a worker slow to exit had the
core killed while it waited, so neither unlinked its shared memory and semaphores (the resource tracker's "leaked"
warnings at exit)."""


class EngineCheck(NamedTuple):
    """One engine's bit-exact check of a sync."""

    engine: int
    mismatches: tuple[str, ...]
    compared: int


class VllmEngines:
    """``count`` live vLLM engines of ``cfg`` (dummy weights until the first sync), their weight-sync calls served
    to the trainer at :attr:`address` (authenticated with ``authkey``)."""

    def __init__(self, cfg: ModelConfig, count: int, authkey: bytes, seed: int = 0) -> None:
        from kvmove.vllm.clients import EngineGroup, LLMClient

        vllm = import_vllm()
        os.environ.update(ENV)
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the worker in its own process
        self._dir = tempfile.TemporaryDirectory(prefix="kvmove-rl-engine-")
        model_dir = write_model_dir(cfg, Path(self._dir.name))
        self.llms: list[Any] = []
        kwargs: dict[str, Any] = {
            "dtype": "bfloat16",
            "max_model_len": MAX_MODEL_LEN,
            "enforce_eager": True,
            "seed": seed,
        }
        kwargs |= {"load_format": "dummy", "weight_transfer_config": {"backend": BACKEND}}
        try:
            for _ in range(count):
                self.llms.append(vllm.LLM(model=str(model_dir), **kwargs))
        except Exception as exc:
            self.close()
            raise KvmoveError(f"vLLM could not start {cfg.name} here: {str(exc).strip()[:300]}") from exc
        self.group = EngineGroup([LLMClient(llm) for llm in self.llms])
        self._server = ControlServer(lambda command: answer_engine_call(self.group, command), "127.0.0.1", authkey)

    @property
    def address(self) -> Address:
        """Where trainer rank 0's ``RemoteEngines`` reaches this side."""
        return self._server.address

    def check(self, checkpoint: str) -> list[EngineCheck]:
        """Every engine's worker compares what its live model computes with against vLLM's own loader and
        processing fed the trainer's saved ``checkpoint`` (``kvmove.vllm.rpc.verify_saved``)."""
        from kvmove.vllm.rpc import verify_saved

        out = []
        for e, llm in enumerate(self.llms):
            ((bad, compared),) = llm.collective_rpc(verify_saved, args=(checkpoint,))
            out.append(EngineCheck(e, tuple(bad), compared))
        return out

    def received(self) -> list[EngineStats]:
        """Each engine worker's pull stats of the last update (``kvmove.vllm.rpc.sync_report``)."""
        from kvmove.vllm.rpc import sync_report

        out = []
        for llm in self.llms:
            ((stats, _finish_s, _memory),) = llm.collective_rpc(sync_report)
            out.append(EngineStats(*stats))  # a NamedTuple crosses vLLM's msgpack as a plain list
        return out

    def versions(self) -> list[str | None]:
        """The weight version each engine reports (``LLM.get_weight_version``)."""
        return [llm.get_weight_version() for llm in self.llms]

    def generate(self, prompts: Sequence[tuple[int, ...]], sampling: Sampling) -> list[list[Completion]]:
        """Per prompt (in order), its ``sampling.n`` completions; the prompts are split over the engines, which
        decode at once."""
        n = len(self.llms)
        parts = [list(prompts[k::n]) for k in range(n)]
        with ThreadPoolExecutor(n, thread_name_prefix="kvmove-rollout") as pool:
            done = list(pool.map(lambda k: _generate(self.llms[k], parts[k], sampling), range(n)))
        per_prompt: list[list[Completion]] = [[] for _ in prompts]
        for k, groups in enumerate(done):
            for j, group in enumerate(groups):
                per_prompt[k + j * n] = group
        return per_prompt

    def close(self) -> None:
        """Release the weight-transfer side of every engine, then stop the engines; idempotent."""
        for llm in self.llms:  # NOTE: the transfer sides first, while the trainer side they were joined to is up
            with contextlib.suppress(Exception):  # an engine whose transfer side never started releases nothing
                llm.shutdown_weight_transfer_engine()
        if getattr(self, "_server", None) is not None:
            self._server.close()
        for llm in self.llms:
            llm.llm_engine.engine_core.shutdown(timeout=ENGINE_SHUTDOWN_S)
        self.llms = []
        self._dir.cleanup()


def _generate(llm: Any, prompts: list[tuple[int, ...]], s: Sampling) -> list[list[Completion]]:
    if not prompts:
        return []
    params = import_vllm().SamplingParams(
        n=s.n, temperature=s.temperature, max_tokens=s.max_tokens, seed=s.seed, ignore_eos=True, logprobs=0
    )
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [[_completion(o, c) for c in o.outputs] for o in outs]


def _completion(out: Any, c: Any) -> Completion:
    """vLLM's output as a Completion: each sampled token's log-probability as vLLM computed it (``logprobs=0``)."""
    steps = c.logprobs or ()
    logprobs = tuple(float(step[t].logprob) for step, t in zip(steps, c.token_ids, strict=True))
    return Completion(tuple(out.prompt_token_ids), tuple(c.token_ids), logprobs)
