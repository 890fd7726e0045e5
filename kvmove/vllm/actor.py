"""The host of one vLLM engine replica: kvmove's engine host (``kvmove.sync.ranks.engine_host``) running a live
vLLM, started by either launcher (``ENGINES["vllm"].host`` names it).

The host is one user of the path any RL framework takes (``kvmove.vllm.join``): it starts a plain
``vllm.LLM`` in vLLM's default multi-process mode with ``weight_transfer_config={"backend": "kvmove"}``, opens
an engine registry of its own and hands the worker the join info through ``init_weight_transfer_engine``. The
worker, in the engine core's process, dry-runs vLLM's loader on its meta-device model, registers that plan here and
builds its own puller from the ``PullerInit`` the host publishes for it (what kvmove's driver sends at init step
5). A sync is vLLM's update (``start_weight_update``, ``update_weights``, ``finish_weight_update``); the worker's
stats, the bit-exact check and the live parameters come back through ``collective_rpc``
(``kvmove.vllm.rpc``).
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

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.directory import write_model_dir
from kvmove.sync.embedded.member import JoinInfo
from kvmove.sync.embedded.registry import EngineRegistry
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.ranks.control import EngineStats, OpenPuller, RunPulls, VerifyResult
from kvmove.sync.ranks.engine_host import EngineHost
from kvmove.sync.ranks.host import RankSpec, handles
from kvmove.transport import EndpointInfo, Transport
from kvmove.vllm import BACKEND, check_layout, import_vllm
from kvmove.vllm.rpc import (
    TransferState,
    WorkerMemory,
    check_weights,
    live_state,
    pack,
    staging_bounds,
    sync_report,
    transfer_state,
    watch_memory,
    watched_memory,
    worker_memory,
)
from kvmove.vllm.session import Memory

__all__ = ["VllmEngineHost", "check_layout", "start_llm"]

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of kvmove.vllm.rpc's functions
}
MAX_MODEL_LEN = 256


def start_llm(cfg: ModelConfig, model_dir: Path, *, load_format: str, transfer: bool, in_process: bool = False) -> Any:
    """A vLLM ``LLM`` of ``cfg`` from ``model_dir``, in vLLM's default multi-process mode (``in_process``: the
    engine core and worker in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where a test reaches the
    worker's backend directly); a clear error if vLLM cannot build it."""
    os.environ.update(ENV)
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
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


class VllmEngineHost(EngineHost):
    """One vLLM engine replica (one rank): a live ``LLM`` whose worker joined this host's registry.

    ``weights`` (tests): start vLLM from these HF tensors on disk instead of dummy weights.
    """

    daemon = False  # vLLM starts its engine core as a child process

    def __init__(self, spec: RankSpec, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        self._weights = weights
        super().__init__(spec)

    def open_transport(self) -> Transport | None:  # type: ignore[override]
        """None: the worker opens its own transport endpoint (from the join info) in its own process."""
        return None

    def build_model(self) -> nn.Module:
        """Start vLLM and init its ``kvmove`` backend with this host's join info: the worker registers here. The
        served model lives in the worker's process (reached through ``collective_rpc``), so this returns an empty
        module."""
        c = self.config
        check_layout(c.engine)
        if c.tensor_format != "hf":
            raise KvmoveError(f"the vLLM engine loads HF checkpoints: --tensor-format {c.tensor_format} is not served")
        self._dir = tempfile.TemporaryDirectory(prefix="kvmove-vllm-")
        model_dir = write_model_dir(c.model, Path(self._dir.name), self._weights)
        self.registry = EngineRegistry(self.spec.authkey, self.address.host)
        load_format = "auto" if self._weights is not None else "dummy"
        self.llm = start_llm(c.model, model_dir, load_format=load_format, transfer=True)
        (self.memory_before_init,) = self.llm.collective_rpc(worker_memory)
        where = self.registry.address
        join = JoinInfo(where.host, where.port, self.spec.authkey.hex(), c.transport, c.deadline_s)
        self.llm.init_weight_transfer_engine({"init_info": join.payload()})
        (self.member,) = self.registry.members()  # tp=1: one worker
        return nn.Module()

    def make_plan(self) -> ShardingPlan:
        """Init step 3: the plan the worker recorded with vLLM's own ``load_weights`` on its meta-device model."""
        return self.member.register.plan

    @handles(OpenPuller)
    def open_puller(self, command: OpenPuller) -> EndpointInfo:
        """Init step 5: publish the worker's ``PullerInit`` (it fetches it at its first update)."""
        self.registry.publish(self.member.ticket, command.init)
        return self.member.register.endpoint

    def pull(self, command: RunPulls) -> EngineStats:
        """vLLM's update: start, update_weights (the worker pulls and commits unit by unit), finish; the engine's
        ``peak_extra_bytes`` is the worker's (window, receive slots, processing: kvmove.vllm.session.Memory)."""
        start = time.perf_counter()
        overlap = command.strategy.overlap
        info = {"sync_id": command.sync_id, "strategy": command.strategy.name, "pipelined": overlap.background_load}
        info |= {"delay_s": command.delay_s, "timeout_s": self.config.deadline_s}
        info |= {"die_after_pulls": command.die_after_pulls}
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(weight_version=str(command.sync_id))
        ((stats, finish_s, memory),) = self.llm.collective_rpc(sync_report)
        report = EngineStats(*stats)  # a NamedTuple crosses vLLM's msgpack as a plain list
        peak = Memory(*memory).peak_extra_bytes if memory else report.peak_extra_bytes
        seconds = time.perf_counter() - start
        return report._replace(seconds=seconds, load_seconds=report.load_seconds + finish_s, peak_extra_bytes=peak)

    def verify(self, version: int, seed: int) -> VerifyResult:
        """Bit-exact check, in the worker, of what the live model computes with (parameters and the read-back
        weights of its linear kernels, kvmove.vllm.verify) against vLLM's own loader and post-processing
        fed the full checkpoint of ``version`` on a fresh model."""
        weights = pack(self.reference(version, seed, "cpu"))
        ((bad, compared),) = self.llm.collective_rpc(check_weights, args=(weights,))
        return VerifyResult(not bad, 1, compared, tuple(bad))

    # -- for tests and reports (RankActor.invoke) -----------------------------------------------------------
    def live_params(self) -> dict[str, torch.Tensor]:
        """What the live model computes with (kvmove.vllm.verify.computed_state)."""
        from safetensors.torch import load

        (state,) = self.llm.collective_rpc(live_state)
        return load(state)

    def transfer_state(self) -> TransferState:
        """How the worker's backend is wired (its process, session, and the join info its puller came from)."""
        (state,) = self.llm.collective_rpc(transfer_state)
        return TransferState(*state)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
        """Greedy continuations of token-id prompts."""
        vllm = import_vllm()
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def tensor_memory(self) -> WorkerMemory:
        """The worker's tensor memory before the backend's init and now, and its staging's sizes."""
        ((now,), (bounds,)) = self.llm.collective_rpc(worker_memory), self.llm.collective_rpc(staging_bounds)
        return WorkerMemory(self.memory_before_init, now, bounds)

    def watch_memory(self) -> None:
        """Measure the worker's tensor memory at every module commit of the next updates (rpc.watch_memory)."""
        self.llm.collective_rpc(watch_memory)

    def watched_memory(self) -> int:
        """The highest tensor memory measured since :meth:`watch_memory`."""
        (peak,) = self.llm.collective_rpc(watched_memory)
        return int(peak)

    def pid(self) -> int:
        return os.getpid()

    def host_sessions(self) -> list[str]:
        """The kvmove sessions open in this host's own process (none: the worker holds its session)."""
        from kvmove.vllm.session import SESSIONS

        return sorted(SESSIONS)

    def close(self) -> None:
        """Release the worker's transfer side, stop vLLM, close the registry; idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.shutdown_weight_transfer_engine()
            finally:
                llm.llm_engine.engine_core.shutdown()
        if getattr(self, "registry", None) is not None:
            self.registry.shutdown()
        super().close()
