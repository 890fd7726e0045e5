"""The ``kvmove`` backend of vLLM's weight-transfer API (imported only inside vLLM processes).

vLLM's four-step update, as kvmove implements it:
- ``init_weight_transfer_engine``: build the served model on the meta device (no memory), dry-run vLLM's own
  ``load_weights`` on it over recording tensors (the plan), decide which parameters must be *staged* (those whose
  post-load processing is not the identity here: kvmove.vllm.stage) and allocate the staging window: slots
  of one commit unit (a decoder layer's staged parameters), not a copy of the model (kvmove.vllm.staging).
  Given the trainer's join info (what kvmove's trainer engine, :mod:`kvmove.vllm.trainer`, sends), the
  worker registers with the trainer by address (:mod:`kvmove.vllm.join`): any engine mode, any process.
- ``start_weight_update``: check the session.
- ``update_weights``: the worker's puller lands each pull: bytes of parameters processing keeps as they are go
  straight into the live parameters, staged ones into the window, and each unit, once complete, is processed and
  committed into the live model before the window slot takes the next (kvmove.vllm.receiver); on a
  pipelined strategy (v3) that commit runs on the loader thread while the next pull is read. An in-process puller's
  tensors are validated whole (names, shapes, dtypes, what the untouched part of a fused parameter needs) before
  the first one lands.
- ``finish_weight_update``: checks every unit the update announced was committed. Between the first byte landing
  in the live model and that check the update is *torn*: if it fails half way, the engine core refuses requests
  (kvmove.vllm.guard) until the same update is retried to completion.
- ``shutdown_weight_transfer_engine``: the session is closed (window, puller and transport endpoint released)
  and leaves the process's session table.

After a finish, the engine core resets vLLM's prefix cache (:mod:`kvmove.vllm.prefix_cache`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from kvmove.models.layout import EngineLayout
from kvmove.sync.embedded.member import JoinInfo
from kvmove.vllm.guard import TORN
from kvmove.vllm.join import join, served_model
from kvmove.vllm.session import BackendError, Session, close_session, open_session, session, staging_plan
from kvmove.vllm.stage import Staging, staged_params
from kvmove.vllm.staging import Budget
from kvmove.vllm.verify import Checked, computed_state, mismatches


@dataclass
class KvmoveInitInfo(WeightTransferInitInfo):
    """What a worker is told at init (plain JSON). With ``registry_host``: the trainer's join info
    (kvmove.sync.embedded.member.JoinInfo): the worker plans, registers and pulls by address, in any engine
    mode. ``session``: attach to an existing in-process session of that key instead of opening one."""

    registry_host: str = ""
    registry_port: int = 0
    authkey: str = ""
    """The run's secret, hex: the trainer ranks' control connections authenticate with it."""
    transport: str = "nixl"
    deadline_s: float = 60.0
    session: str = ""
    staging_bytes: int = 0
    """The staging budget in bytes (0: the window holds what the sync's landing order needs, one decoder layer's
    staged parameters for v1 and v3); a sync that needs more is refused before any byte lands."""


@dataclass
class KvmoveUpdateInfo(WeightTransferUpdateInfo):
    sync_id: int
    strategy: str
    pipelined: bool = False
    delay_s: float = 0.0
    timeout_s: float = 60.0
    die_after_pulls: int | None = None
    """Fault injection: the worker's process dies once that many of its pulls finished (as a crash would)."""


class KvmoveTransferEngine(WeightTransferEngine[KvmoveInitInfo, KvmoveUpdateInfo]):
    """kvmove pulls into the live model and a bounded staging window, committing unit by unit (module docstring)."""

    init_info_cls = KvmoveInitInfo
    update_info_cls = KvmoveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.key: str | None = None
        self.pending: set[str] = set()
        """Checkpoint tensors received since the last finish that committed."""

    def fresh_model(self, device: str | torch.device | None = None) -> nn.Module:
        """A new, unprocessed vLLM model of the served config on ``device`` (default: the engine's; "meta": no
        memory). Attention layers register under new names, outside the live model's forward context."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        cc = self.vllm_config.compilation_config
        saved, cc.static_forward_context = cc.static_forward_context, {}
        try:
            with (
                set_current_vllm_config(self.vllm_config),
                set_default_torch_dtype(self.model_config.dtype),
                torch.device(device or self.device),
            ):
                return initialize_model(vllm_config=self.vllm_config)
        finally:
            cc.static_forward_context = saved

    def reference(self, weights: Any) -> nn.Module:
        """vLLM's own loader and post-load processing over ``weights`` on a fresh model (for verification)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model = self.fresh_model()
        with torch.no_grad():
            model.load_weights(weights)  # type: ignore[operator]
        with set_current_vllm_config(self.vllm_config):
            process_weights_after_loading(model, self.model_config, self.device)
        return model

    def parse_init_info(self, init_dict: dict[str, Any]) -> KvmoveInitInfo:
        """vLLM's parse (an unknown key is a ValueError), and, as vLLM's own engines refuse an init_info that lacks
        what they need, a ValueError for one that names neither a trainer registry nor an in-process session."""
        info = super().parse_init_info(init_dict)
        if not info.session and not info.registry_host:
            raise ValueError(
                f"Invalid init_info for {type(self).__name__}: it names neither a trainer registry (registry_host, "
                "registry_port, authkey: what kvmove's trainer engine sends) nor an in-process session"
            )
        return info

    def init_transfer_engine(self, init_info: KvmoveInitInfo) -> None:
        if not init_info.session and not init_info.registry_host:
            raise BackendError(
                "kvmove backend: init_info names neither a trainer registry (registry_host, registry_port, authkey: "
                "what kvmove's trainer engine sends) nor an in-process session"
            )
        s = session(init_info.session) if init_info.session else open_session()
        if self.key == s.key:
            s.close()  # a re-init of the same session: what it held is released, the session stays
        elif self.key is not None:
            self.shutdown()
        s.live, s.meta, s.reference = self.model, self.fresh_model("meta"), self.reference
        self.pending = set()
        self.key = s.key
        budget = Budget(init_info.staging_bytes)
        try:
            if init_info.registry_host:
                join(s, self._join_info(init_info), self.vllm_config, self.device, self._staging(s, budget))
            else:  # an in-process session (tests): one rank
                s.plan = self._plan(s, EngineLayout(), 0)
                s.stager = Staging(s.live, s.meta, s.plan, self.vllm_config, self.device, budget)
        except BaseException:
            self.shutdown()
            raise

    def _plan(self, s: Session, layout: EngineLayout, rank: int) -> Any:
        """The dry run on the meta model, with the parameters this device stages marked."""
        import dataclasses

        assert s.live is not None and s.meta is not None
        plan = staging_plan(served_model(self.vllm_config), s.meta, layout, rank)
        return dataclasses.replace(plan, staged=staged_params(s.live, s.meta, plan, torch.device(self.device).type))

    def _staging(self, s: Session, budget: Budget) -> Any:
        """For join: plan this rank (its layout and rank known there), then build its staging."""

        def build(layout: EngineLayout, rank: int) -> Staging:
            s.plan = self._plan(s, layout, rank)
            s.stager = Staging(s.require(), s.meta, s.plan, self.vllm_config, self.device, budget)  # type: ignore[arg-type]
            return s.stager

        return build

    @staticmethod
    def _join_info(info: KvmoveInitInfo) -> JoinInfo:
        return JoinInfo(info.registry_host, info.registry_port, info.authkey, info.transport, info.deadline_s)

    def start_weight_update(self) -> None:
        self._session().require()

    def receive_weights(self, update_info: KvmoveUpdateInfo) -> None:
        s = self._session()
        if s.puller is None:
            raise BackendError(f"kvmove session {s.key} has no puller (init_info named no trainer registry)")
        staging: Staging = s.stager
        try:
            if s.joined is not None:  # kvmove's puller lands in the live model from its first pull on
                s.torn = s.torn or f"sync {update_info.sync_id} ({update_info.strategy})"
            received = s.puller(update_info.__dict__)
            if received.payload is not None:
                staging.validate(received.payload, self._shapes())
                if received.payload:
                    s.torn = s.torn or f"the update of {len(received.payload)} tensors"
                staging.land(received.payload)
        except BaseException as exc:
            if s.torn:
                raise BackendError(f"{TORN}: {s.torn} failed half way ({exc}); retry the same update") from exc
            raise
        s.last_stats = received.stats
        self.pending |= received.tensors

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        from kvmove.models.checkpoint import engine_tensors

        return {t.name: t.shape for t in engine_tensors(served_model(self.vllm_config))}

    def finish_weight_update(self) -> None:
        s = self._session()
        s.require()
        start = time.perf_counter()
        staging: Staging = s.stager
        missing = staging.stager.missing()
        if missing:
            raise BackendError(
                f"{TORN}: {s.torn or 'the update'} did not complete: {missing[:3]} did not receive all their bytes; "
                "retry the same update (update_weights) to completion"
            )
        s.torn, self.pending = "", set()
        recv = int(getattr(s.last_stats, "peak_extra_bytes", 0) or 0) if s.last_stats is not None else 0
        s.memory = staging.memory(recv)
        s.finish_seconds = time.perf_counter() - start

    def check(self, weights: dict[str, torch.Tensor]) -> Checked:
        """Keys where the live model computes with other bits than vLLM's loader and processing make of
        ``weights`` on a fresh model (kvmove.vllm.verify), and how many keys were compared."""
        s = self._session()
        live = s.require()
        assert s.reference is not None
        with torch.no_grad():
            got = computed_state(live)
            return Checked(mismatches(got, computed_state(s.reference(weights.items()))), len(got))

    def current(self) -> Session:
        """This engine's session (a RuntimeError before init or after shutdown)."""
        return self._session()

    def shutdown(self) -> None:
        if self.key is not None:
            close_session(self.key)
        self.key, self.pending = None, set()

    def _session(self) -> Session:
        if self.key is None:
            raise BackendError(
                "kvmove backend: init_weight_transfer_engine has not run (or shutdown_weight_transfer_engine "
                "released it): call init_weight_transfer_engine first"
            )
        return session(self.key)
