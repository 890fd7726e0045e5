"""The host of one vLLM engine replica: kvmove's engine host (``kvmove.sync.ranks.engine_host``) running a live
vLLM, started by either launcher (``ENGINES["vllm"].host`` names it).

vLLM runs in-process here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), so the ``kvmove``
weight-transfer backend it creates shares this process and reaches the host through a session
(kvmove.engines.vllm.session). The plan is a dry run of vLLM's own loader on the staging model; syncs pull into
the staging tensors and vLLM's four-step update (start, update, finish) brings them into the live engine.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvmove.engines.vllm import BACKEND, check_layout, import_vllm
from kvmove.engines.vllm.checkpoint import write_model_dir
from kvmove.engines.vllm.session import Received, open_session, staging_plan
from kvmove.engines.vllm.verify import computed_state, mismatches
from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.sync.planning.formats import get_format
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.ranks.control import Completion, EngineStats, Generate, RunPulls, VerifyResult
from kvmove.sync.ranks.engine_host import EngineHost
from kvmove.sync.ranks.host import RankSpec, handles

__all__ = ["VllmEngineHost", "check_layout", "start_llm"]

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # EngineCore and worker in this process: the session reaches them
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
MAX_MODEL_LEN = 256


def start_llm(cfg: ModelConfig, model_dir: Path, *, load_format: str, transfer: bool) -> Any:
    """An in-process vLLM ``LLM`` of ``cfg`` from ``model_dir``; a clear error if vLLM cannot build it."""
    os.environ.update(ENV)
    vllm = import_vllm()
    kwargs: dict[str, Any] = {"weight_transfer_config": {"backend": BACKEND}} if transfer else {}
    try:
        llm = vllm.LLM(
            model=str(model_dir),
            dtype="bfloat16",
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
            load_format=load_format,
            distributed_executor_backend="uni",
            seed=0,
            **kwargs,
        )
    except Exception as exc:
        raise KvmoveError(f"vLLM could not build {cfg.name} ({cfg.architecture}) here: {_first_line(exc)}") from exc
    try:  # some limits (attention head sizes, kernels) only show at the first forward pass
        llm.generate([{"prompt_token_ids": [1, 2]}], vllm.SamplingParams(max_tokens=1), use_tqdm=False)
    except Exception as exc:
        raise KvmoveError(f"vLLM could not run {cfg.name} ({cfg.architecture}) here: {_first_line(exc)}") from exc
    return llm


def _sampled_logprobs(completion: Any) -> tuple[float, ...]:
    """The log-probability vLLM reports for each token it sampled (``logprobs=0``: the sampled one only)."""
    steps = completion.logprobs or ()
    return tuple(float(step[t].logprob) for step, t in zip(steps, completion.token_ids, strict=True))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


class VllmEngineHost(EngineHost):
    """One vLLM engine replica (one rank): a live ``LLM``, its staging model, plan and puller.

    ``weights`` (tests): start vLLM from these HF tensors on disk instead of dummy weights.
    """

    def __init__(self, spec: RankSpec, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        self._weights = weights
        self._command: RunPulls | None = None
        super().__init__(spec)

    def build_model(self) -> nn.Module:
        """Start vLLM with kvmove's weight-transfer backend; the served (live) model is vLLM's."""
        cfg = self.config.model
        check_layout(self.config.engine)
        self._dir = tempfile.TemporaryDirectory(prefix="kvmove-vllm-")
        model_dir = write_model_dir(cfg, Path(self._dir.name), self._weights)
        self.session = open_session()
        load_format = "auto" if self._weights is not None else "dummy"
        self.llm = start_llm(cfg, model_dir, load_format=load_format, transfer=True)
        self.llm.init_weight_transfer_engine({"init_info": {"session": self.session.key}})
        self.session.puller, self.session.release = self._pull_into_staging, self._release
        live, _ = self.session.require()
        return live

    def target(self) -> nn.Module:
        """Pulls land in the staging model; vLLM's finish step re-processes them into the live one."""
        return self.session.require()[1]

    def make_plan(self) -> ShardingPlan:
        """Init step 3: dry-run vLLM's own ``load_weights`` on the (unprocessed) staging model."""
        c = self.config
        source = get_format(c.tensor_format).source_tensors(c.model, c.trainer)
        self.session.plan = staging_plan(c.model, self.target(), c.engine, self.spec.rank, source=source)
        return self.session.plan

    def pull(self, command: RunPulls) -> EngineStats:
        """vLLM's update: start, update_weights (the puller fills the staging tensors), finish (re-process)."""
        start = time.perf_counter()
        self._command = command
        overlap = command.strategy.overlap
        info = {"sync_id": command.sync_id, "strategy": command.strategy.name, "pipelined": overlap.background_load}
        info |= {"delay_s": command.delay_s, "timeout_s": self.config.deadline_s}
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(weight_version=str(command.sync_id))
        stats: EngineStats = self.session.last_stats
        return stats._replace(
            seconds=time.perf_counter() - start, load_seconds=stats.load_seconds + self.session.finish_seconds
        )

    def _pull_into_staging(self, _info: dict[str, Any]) -> Received:
        """The session's puller (called by the kvmove backend inside ``update_weights``): one sync into the
        staging tensors. A sync moves the whole checkpoint: every tensor of the plan."""
        if self._command is None or self._puller is None:
            raise KvmoveError("vLLM engine host: no sync in progress, or the session was shut down")
        with torch.no_grad():
            stats = super().pull(self._command)
        return Received(stats, frozenset(r.hf_name for r in self.plan.regions))

    def _release(self) -> None:
        """The session's release hook: drop the receiving side and deregister what it registered."""
        if self._puller is not None:
            self._puller.close()
        self._puller = None
        self.transport.close()

    def verify(self, version: int, seed: int) -> VerifyResult:
        """Bit-exact check of what the live model computes with (parameters and the read-back weights of its
        linear kernels, kvmove.engines.vllm.verify) against vLLM's own loader and post-processing fed the full
        checkpoint of ``version`` on a fresh model."""
        live, _ = self.session.require()
        assert self.session.reference is not None
        want = computed_state(self.session.reference(self.reference(version, seed, "cpu").items()))
        got = computed_state(live)
        bad = mismatches(got, want)
        return VerifyResult(not bad, 1, len(got), tuple(bad))

    @handles(Generate)
    def generate_rollouts(self, command: Generate) -> list[Completion]:
        """Rollouts from the live weights: ``n`` continuations per prompt, each sampled token's log-probability
        as vLLM computed it (the raw model distribution)."""
        s = command.sampling
        params = import_vllm().SamplingParams(
            n=s.n, temperature=s.temperature, max_tokens=s.max_tokens, seed=s.seed, ignore_eos=True, logprobs=0
        )
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in command.prompts], params, use_tqdm=False)
        return [
            Completion(tuple(o.prompt_token_ids), tuple(c.token_ids), _sampled_logprobs(c))
            for o in outs
            for c in o.outputs
        ]

    # -- for tests and reports (RankActor.invoke) -----------------------------------------------------------
    def live_params(self) -> dict[str, torch.Tensor]:
        """What the live model computes with (kvmove.engines.vllm.verify.computed_state)."""
        live, _ = self.session.require()
        return computed_state(live)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
        """Greedy continuations of token-id prompts."""
        vllm = import_vllm()
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def pid(self) -> int:
        return os.getpid()
