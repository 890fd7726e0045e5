"""One vLLM engine replica in a Ray actor, with the reference engine actor's interface (kvmove.sync.actors).

vLLM runs in-process here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), so the ``kvmove``
weight-transfer backend it creates shares this process and reaches the actor through a session
(kvmove.engines.vllm.session). The plan is a dry run of vLLM's own loader on the staging model; syncs pull into
the staging tensors and vLLM's four-step update (start, update, finish) brings them into the live engine.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch

from kvmove.engines.vllm import BACKEND, import_vllm
from kvmove.engines.vllm.checkpoint import write_model_dir
from kvmove.engines.vllm.session import Received, open_session, staging_plan
from kvmove.engines.vllm.verify import computed_state, mismatches
from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout
from kvmove.models.config import ModelConfig
from kvmove.sync.actors import ActorClient
from kvmove.sync.engine import EngineRank, EngineStats, TrainerEndpoint, open_engine_rank
from kvmove.sync.plan import ShardingPlan
from kvmove.sync.schedule import PullPlan
from kvmove.sync.verify import seeded_checkpoint
from kvmove.transport import ACTOR_OPTIONS, BufferDesc, EndpointInfo, ServesSlots, get_transport

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # EngineCore and worker in this process: the session reaches them
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
MAX_MODEL_LEN = 256


def check_layout(layout: EngineLayout) -> None:
    """vLLM engine replicas here are single-rank (tensor_parallel_size=1 on CPU); more replicas give dp."""
    if layout.ranks_per_replica != 1:
        raise KvmoveError(
            f"engine layout {layout.label()} does not match the vLLM engines kvmove starts here "
            "(tensor_parallel_size=1 per replica on CPU): use --engine tp=1 and --replicas for data parallelism"
        )


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


@ray.remote(**ACTOR_OPTIONS)
class VllmEngineActor(ServesSlots):
    """One vLLM engine replica (one rank): a live ``LLM``, its staging model, plan and registered buffers.

    ``weights`` (tests): start from these HF tensors on disk instead of dummy weights.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layout: EngineLayout,
        rank: int,
        transport: str,
        options: dict[str, Any],
        engine_kind: str = "vllm",
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        check_layout(layout)
        torch.set_num_threads(1)
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.coord = layout.coord(rank)
        self._dir = tempfile.TemporaryDirectory(prefix="kvmove-vllm-")
        model_dir = write_model_dir(cfg, Path(self._dir.name), weights)
        self.session = open_session()
        self.llm = start_llm(cfg, model_dir, load_format="auto" if weights is not None else "dummy", transfer=True)
        self.llm.init_weight_transfer_engine({"init_info": {"session": self.session.key}})
        self.session.puller, self.session.release = self._pull, self._release
        self.transport = get_transport(transport)(**options)
        self.plan: ShardingPlan | None = None
        self.impl: EngineRank | None = None
        self._trainers: dict[int, Any] = {}
        self._endpoints: dict[int, TrainerEndpoint] = {}
        self._recv: dict[str, list[BufferDesc]] = {}
        self._params: dict[str, BufferDesc] = {}
        self._pulls: dict[str, PullPlan] = {}
        self._timeout_s = 60.0

    # -- the reference engine actor's interface ------------------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def hostname(self) -> str:
        return socket.gethostname()

    def build_plan(self) -> tuple[ShardingPlan, float]:
        """Init step 3: dry-run vLLM's own ``load_weights`` on the (unprocessed) staging model."""
        _, staging = self.session.require()
        t0 = time.perf_counter()
        self.plan = self.session.plan = staging_plan(self.cfg, staging, self.layout, self.rank)
        return self.plan, time.perf_counter() - t0

    def setup(
        self,
        pulls: dict[str, PullPlan],
        recv_sizes: dict[str, tuple[int, int]],
        direct_params: list[str],
        trainers: dict[int, Any],
        trainer_info: dict[int, TrainerEndpoint],
    ) -> EndpointInfo:
        """Init step 5: register receive slots and the staging parameters direct pulls write, once."""
        _, staging = self.session.require()
        assert self.plan is not None
        side = open_engine_rank(self.transport, staging, self.plan, recv_sizes, direct_params, trainer_info)
        self.impl, self._recv, self._params = side
        self._pulls, self._trainers, self._endpoints = pulls, trainers, dict(trainer_info)
        return self.transport.endpoint_info()

    def run_sync(self, sync_id: int, strategy: str, pipelined: bool, delay_s: float, timeout_s: float) -> EngineStats:
        """vLLM's update: start, update_weights (our puller fills the staging tensors), finish (re-process)."""
        start = time.perf_counter()
        self._timeout_s = timeout_s
        info = {"sync_id": sync_id, "strategy": strategy, "pipelined": pipelined, "delay_s": delay_s}
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info | {"timeout_s": timeout_s}})
        self.llm.finish_weight_update(weight_version=str(sync_id))
        stats: EngineStats = self.session.last_stats
        return stats._replace(
            seconds=time.perf_counter() - start, load_seconds=stats.load_seconds + self.session.finish_seconds
        )

    def broadcast_receive(self, *_args: Any) -> EngineStats:
        raise KvmoveError("the broadcast baseline is not built for --engine-kind vllm (use v1, v2 or v3)")

    def verify(self, version: int, seed: int) -> tuple[bool, list[str]]:
        """Bit-exact check of what the live model computes with (parameters and the read-back weights of its
        linear kernels, kvmove.engines.vllm.verify) against vLLM's own loader and post-processing fed the full
        checkpoint of ``version`` on a fresh model."""
        live, _ = self.session.require()
        assert self.session.reference is not None
        want = computed_state(self.session.reference(seeded_checkpoint(self.cfg, seed, version).items()))
        bad = mismatches(computed_state(live), want)
        return not bad, bad

    # -- for tests and reports -----------------------------------------------------------------------------
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

    # -- the session's puller (called by the kvmove backend inside update_weights) --------------------------
    def _pull(self, info: dict[str, Any]) -> Received:
        """One sync into the staging tensors. A sync moves the whole checkpoint: every tensor of the plan."""
        if self.impl is None or self.plan is None:
            raise KvmoveError("vLLM engine actor: setup has not run (or the session was shut down)")
        client = ActorClient(self, info["strategy"], self._timeout_s)  # type: ignore[arg-type]
        with torch.no_grad():
            stats = self.impl.run_sync(
                info["sync_id"],
                info["strategy"],
                self._pulls[info["strategy"]],
                client,
                pipelined=bool(info["pipelined"]),
                delay_s=float(info["delay_s"]),
            )
        return Received(stats, frozenset(r.hf_name for r in self.plan.regions))

    def _release(self) -> None:
        """The session's release hook: deregister what setup registered and drop the receiving side."""
        self.impl, self._recv, self._params = None, {}, {}
        self.transport.close()
