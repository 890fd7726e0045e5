"""The ``kvmove`` backend of vLLM's weight-transfer API (imported only inside vLLM processes).

vLLM's four-step update, as kvmove implements it:
- ``init_weight_transfer_engine``: build a fresh, unprocessed vLLM model of the served config (the *staging*
  model), load into it what the live model was loaded from (vLLM's own loader, unprocessed), and open a session
  holding it, the live model and vLLM's loader. Given the trainer's join info (what kvmove's trainer engine,
  :mod:`kvmove.engines.vllm.trainer`, sends), the worker then dry-runs vLLM's own ``load_weights`` over
  recording tensors on the staging model (the plan) and registers with the trainer by address
  (:mod:`kvmove.engines.vllm.join`): any engine mode, any process.
- ``start_weight_update``: check the session.
- ``update_weights``: the worker's puller moves checkpoint tensors from trainer ranks into the staging model
  and names them.
- ``finish_weight_update``: only the modules owning a staging parameter those tensors fill are re-processed
  (vLLM's post-load processing) and copied into the live parameters' storage, all or nothing
  (:mod:`kvmove.engines.vllm.update`); an update that received nothing changes nothing. A failed finish
  leaves the live model as it was and can be called again.
- ``shutdown_weight_transfer_engine``: the session is closed (staging model, puller and transport endpoint
  released) and leaves the process's session table.

After a finish, the engine core resets vLLM's prefix cache (:mod:`kvmove.engines.vllm.prefix_cache`).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from kvmove.engines.vllm.join import join
from kvmove.engines.vllm.session import BackendError, Session, close_session, open_session, session
from kvmove.engines.vllm.update import commit, owners, prepare
from kvmove.engines.vllm.verify import computed_state, mismatches
from kvmove.sync.embedded.member import JoinInfo

UPDATED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Live models a kvmove update changed: their checkpoint on disk no longer describes them."""


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
    """kvmove pulls into a staging copy of the model; finish re-processes what changed into the live one."""

    init_info_cls = KvmoveInitInfo
    update_info_cls = KvmoveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.key: str | None = None
        self.pending: set[str] = set()
        """Checkpoint tensors received since the last finish that committed."""
        self.known: set[str] | None = None
        """Checkpoint tensors whose values the staging model holds (None: all of them)."""

    def fresh_model(self) -> nn.Module:
        """A new, unprocessed vLLM model of the served config (attention layers register under new names)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        cc = self.vllm_config.compilation_config
        saved, cc.static_forward_context = cc.static_forward_context, {}
        try:
            with (
                set_current_vllm_config(self.vllm_config),
                set_default_torch_dtype(self.model_config.dtype),
                torch.device(self.device),
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
        staging = self.fresh_model()
        with torch.no_grad():
            for p in staging.parameters():
                p.zero_()  # regions no loader write covers (padding) stay zero, as after a load
        self.known = None if self._load_baseline(staging) else set()
        self.pending = set()
        s.live, s.staging, s.reference = self.model, staging, self.reference
        self.key = s.key
        if init_info.registry_host:
            try:
                join(s, self._join_info(init_info), self.vllm_config, self.device)
            except BaseException:
                self.shutdown()
                raise

    @staticmethod
    def _join_info(info: KvmoveInitInfo) -> JoinInfo:
        return JoinInfo(info.registry_host, info.registry_port, info.authkey, info.transport, info.deadline_s)

    def _load_baseline(self, staging: nn.Module) -> bool:
        """Load what the live model was loaded from into ``staging`` (unprocessed), so that an update carrying
        part of a fused parameter keeps the rest; False where that is not known (then staging starts blank)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

        if self.model in UPDATED:
            return False
        loader = get_model_loader(self.vllm_config.load_config)
        if not isinstance(loader, (DefaultModelLoader, DummyModelLoader)):
            return False
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loader.load_weights(staging, self.model_config)
        return True

    def start_weight_update(self) -> None:
        self._session().require()

    def receive_weights(self, update_info: KvmoveUpdateInfo) -> None:
        s = self._session()
        if s.puller is None:
            raise BackendError(f"kvmove session {s.key} has no puller (init_info named no trainer registry)")
        received = s.puller(update_info.__dict__)
        s.last_stats = received.stats
        self.pending |= received.tensors
        if self.known is not None:
            self.known |= received.tensors

    def finish_weight_update(self) -> None:
        s = self._session()
        live, staging = s.require()
        start = time.perf_counter()
        if self.pending:
            params = self._updated_params(s)
            commit(prepare(live, staging, owners(staging, params), self.vllm_config))
            UPDATED.add(live)
            self.pending = set()
        s.finish_seconds = time.perf_counter() - start

    def _updated_params(self, s: Session) -> set[str]:
        """Staging parameters the pending tensors fill; each must be fully known (no blank part left)."""
        regions = s.require_plan().regions
        params = {r.param for r in regions if r.hf_name in self.pending}
        if self.known is not None:
            blank = sorted({r.hf_name for r in regions if r.param in params and r.hf_name not in self.known})
            if blank:
                raise BackendError(
                    f"kvmove: the staging model has no values yet for {blank[:4]}{' ...' if len(blank) > 4 else ''} "
                    "(it started blank: this engine's checkpoint on disk is stale or its load format unknown); "
                    "the first update after init_weight_transfer_engine must carry whole parameters: send "
                    "those too (update_weights again), then finish_weight_update"
                )
        return params

    def check(self, weights: dict[str, torch.Tensor]) -> tuple[list[str], int]:
        """Keys where the live model computes with other bits than vLLM's loader and processing make of
        ``weights`` on a fresh model (kvmove.engines.vllm.verify), and how many keys were compared."""
        s = self._session()
        live, _ = s.require()
        assert s.reference is not None
        with torch.no_grad():
            got = computed_state(live)
            return mismatches(got, computed_state(s.reference(weights.items()))), len(got)

    def current(self) -> Session:
        """This engine's session (a RuntimeError before init or after shutdown)."""
        return self._session()

    def shutdown(self) -> None:
        if self.key is not None:
            close_session(self.key)
        self.key, self.pending, self.known = None, set(), None

    def _session(self) -> Session:
        if self.key is None:
            raise BackendError(
                "kvmove backend: init_weight_transfer_engine has not run (or shutdown_weight_transfer_engine "
                "released it): call init_weight_transfer_engine first"
            )
        return session(self.key)
