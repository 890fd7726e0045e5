"""The engine rank's host: the engine's model on its device, its plan, its puller, behind typed commands.

Subclasses host other engines (``ENGINES[kind].host``; the vLLM host runs a live vLLM): they override
``build_model`` (the served model), ``target`` (the module pulls write into), ``make_plan``, ``pull`` and
``verify``, and inherit the rest.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch
from torch import nn

from kvmove.engines import get_engine
from kvmove.errors import KvmoveError
from kvmove.models.checkpoint import engine_checkpoint, engine_tensors
from kvmove.models.totals import model_totals
from kvmove.models.weights import VERIFY_LIMIT_BYTES, saved_checkpoint, seeded_checkpoint
from kvmove.sync.planning.formats import get_format
from kvmove.sync.planning.plan import ShardingPlan, plan_rank
from kvmove.sync.ranks.broadcast import KeptGroup, receive_all
from kvmove.sync.ranks.control import (
    BuildPlan,
    EngineStats,
    MeasureCopy,
    OpenPuller,
    PlanReport,
    ReceiveBroadcast,
    RunPulls,
    VerifyResult,
    VerifyWeights,
)
from kvmove.sync.ranks.host import Host, RankSpec, die_after, finished, handles, release_freed_memory
from kvmove.sync.ranks.puller import Puller, open_puller
from kvmove.sync.verify import bits_equal, verify_streaming
from kvmove.transport import EndpointInfo
from kvmove.transport.bandwidth import copy_ceiling


class EngineHost(Host):
    """One engine rank of the reference engine (or, subclassed, another engine)."""

    def __init__(self, spec: RankSpec) -> None:
        super().__init__(spec)
        c = self.config
        self.adapter = get_engine(c.engine_kind)
        self.coord = c.engine.coord(spec.rank)
        self.transport = self.open_transport()
        self.model = self.build_model()
        self._plan: ShardingPlan | None = None
        self._puller: Puller | None = None
        self._broadcast = KeptGroup()

    # -- what an engine kind provides -------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The served model of this rank, on its device."""
        c = self.config
        return self.adapter.build(c.model, c.engine, self.coord, device=self.spec.device)

    def target(self) -> nn.Module:
        """The module whose parameters the pulls write (the plan's ``params``)."""
        return self.model

    def make_plan(self) -> ShardingPlan:
        """Init step 3: dry-run this engine's own loader over recording tensors."""
        c = self.config
        source = get_format(c.tensor_format).source_tensors(c.model, c.trainer)
        return plan_rank(c.model, c.engine, self.coord, reuse=c.options.reuse, engine=self.adapter, source=source)

    def pull(self, command: RunPulls) -> EngineStats:
        """One sync's pulls into ``target()``."""
        hook = die_after(command.die_after_pulls)
        return self.puller.run(command.sync_id, command.strategy, command.delay_s, hook)

    def verify(self, version: int, seed: int) -> VerifyResult:
        """Bit-exact check against this engine's own loader fed the full checkpoint of ``version`` in the engine's
        format (an FP8 engine's own quantizer on whole tensors); a checkpoint too large to materialize here is
        checked tensor by tensor against the plan's op chains instead."""
        c, weights = self.config, self.weights_device()
        replayed = getattr(c.source, "checkpoint", None) is not None
        if model_totals(c.model).total_bytes > VERIFY_LIMIT_BYTES and c.reference is None and not replayed:
            return verify_streaming(c.model, self.plan, self.model, seed, version, weights)
        ref = self.adapter.build(c.model, c.engine, self.coord, device=self.spec.device)
        checkpoint = engine_checkpoint(c.model, self.reference(version, seed, weights))
        self.adapter.load_weights(ref, checkpoint.items())
        want = dict(ref.named_parameters())
        params = list(self.model.named_parameters())
        bad = [n for n, p in params if not bits_equal(p.data, want[n].data)]
        return VerifyResult(not bad, 1, len(params), tuple(bad))

    def reference(self, version: int, seed: int, device: str) -> dict[str, torch.Tensor]:
        """The full HF checkpoint of training step ``version``: saved by the trainer (``SyncConfig.reference``)
        or seeded."""
        c = self.config
        if c.reference is not None:
            return saved_checkpoint(c.model, c.reference.format(version=version), device)
        replay = getattr(c.source, "checkpoint", None)  # a source that can say what it served (kvmove.sync.delta)
        if replay is not None:
            return dict(replay(c.model, seed, version, device))
        return seeded_checkpoint(c.model, seed, version, device)

    def weights_device(self) -> str:
        """Where to generate reference weights: seeded bits depend on the device kind, so on the trainer's kind."""
        trainer = self.config.placement.trainer_device(0)
        return self.spec.device if trainer.split(":")[0] == self.spec.device.split(":")[0] else trainer

    # -- commands ---------------------------------------------------------------------------------------------
    @property
    def plan(self) -> ShardingPlan:
        if self._plan is None:
            raise KvmoveError(f"engine rank {self.spec.rank}: BuildPlan first")
        return self._plan

    @property
    def puller(self) -> Puller:
        if self._puller is None:
            raise KvmoveError(f"engine rank {self.spec.rank}: OpenPuller first")
        return self._puller

    @handles(BuildPlan)
    def build_plan(self, _: BuildPlan) -> PlanReport:
        t0 = time.perf_counter()
        self._plan = self.make_plan()
        return PlanReport(self._plan, time.perf_counter() - t0, os.getpid())

    @handles(OpenPuller)
    def open_puller(self, command: OpenPuller) -> EndpointInfo:
        if self._puller is not None:
            self._puller.close()
        device = self.spec.device
        self._puller = open_puller(command.init, self.target(), self.plan, transport=self.transport, device=device)
        return self._puller.endpoint_info()

    @handles(RunPulls)
    def run_pulls(self, command: RunPulls) -> EngineStats:
        cpu = time.process_time()
        with torch.no_grad():
            stats = self.pull(command)
        self._synchronize()
        return finished(stats, cpu)

    @handles(ReceiveBroadcast)
    def receive_broadcast(self, command: ReceiveBroadcast) -> EngineStats:
        cpu = time.process_time()
        c, device = self.config, self.spec.device
        pg = self._broadcast.get(command.group, command.member, device, c.deadline_s)
        if c.tensor_format == "hf":  # the trainer sent the engine's checkpoint (an FP8 engine's quantized)
            stats = receive_all(engine_tensors(c.model), pg, self.adapter, self.model, self.spec.rank, device)
        else:  # the trainer's own tensors, BF16: converted to HF by views, then to the engine's checkpoint
            fmt = get_format(c.tensor_format)
            to_hf = fmt.source_tensors(c.model, c.trainer).to_hf

            def convert(ws: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
                return engine_checkpoint(c.model, dict(to_hf(ws))).items()

            metas = fmt.tensors(c.model, c.trainer)
            stats = receive_all(metas, pg, self.adapter, self.model, self.spec.rank, device, convert)
        return finished(stats, cpu)

    @handles(VerifyWeights)
    def verify_weights(self, command: VerifyWeights) -> VerifyResult:
        with torch.no_grad():
            result = self.verify(command.version, command.seed)
        release_freed_memory()
        return result

    @handles(MeasureCopy)
    def measure_copy(self, command: MeasureCopy) -> float:
        return copy_ceiling(command.source, self.spec.device, command.nbytes)

    def _synchronize(self) -> None:
        if self.spec.device.startswith("cuda"):
            torch.cuda.synchronize(self.spec.device)
