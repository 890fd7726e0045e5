"""The ``kvmove`` backend of vLLM's weight-transfer API (imported only inside vLLM processes).

vLLM's four-step update, as kvmove implements it:
- ``init_weight_transfer_engine``: build a fresh, unprocessed vLLM model of the served config (the *staging*
  model, zeroed; checkpoint layout) and attach it, the live model and vLLM's loader to the actor's session;
  the actor then dry-runs vLLM's own ``load_weights`` over recording tensors on it (the plan).
- ``start_weight_update``: check the session.
- ``update_weights``: the actor's puller moves this sync's bytes from trainer ranks into the staging tensors.
- ``finish_weight_update``: for every live module, run vLLM's post-load processing on the staging values and
  copy the result into the live parameters' storage (what a fresh load would have left there).
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

from kvmove.engines.vllm.session import session


@dataclass
class KvmoveInitInfo(WeightTransferInitInfo):
    session: str


@dataclass
class KvmoveUpdateInfo(WeightTransferUpdateInfo):
    sync_id: int
    strategy: str
    pipelined: bool = False
    delay_s: float = 0.0
    timeout_s: float = 60.0


class KvmoveTransferEngine(WeightTransferEngine[KvmoveInitInfo, KvmoveUpdateInfo]):
    """kvmove pulls into a staging copy of the model; finish re-processes it into the live parameters."""

    init_info_cls = KvmoveInitInfo
    update_info_cls = KvmoveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.key: str | None = None

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

    def init_transfer_engine(self, init_info: KvmoveInitInfo) -> None:
        s = session(init_info.session)
        staging = self.fresh_model()
        with torch.no_grad():
            for p in staging.parameters():
                p.zero_()  # regions no loader write covers (padding) stay zero, as after a load
        s.live, s.staging, s.reference = self.model, staging, self.reference
        self.key = init_info.session

    def start_weight_update(self) -> None:
        assert self.key is not None, "init_weight_transfer_engine first"
        session(self.key).require()

    def receive_weights(self, update_info: KvmoveUpdateInfo) -> None:
        assert self.key is not None, "init_weight_transfer_engine first"
        s = session(self.key)
        if s.puller is None:
            raise RuntimeError(f"kvmove session {self.key} has no puller")
        s.last_stats = s.puller(update_info.__dict__)

    def finish_weight_update(self) -> None:
        assert self.key is not None, "init_weight_transfer_engine first"
        s = session(self.key)
        live, staging = s.require()
        start = time.perf_counter()
        process_into(live, staging, self.vllm_config)
        s.finish_seconds = time.perf_counter() - start

    def shutdown(self) -> None:
        self.key = None


def process_into(live: nn.Module, staging: nn.Module, vllm_config: Any) -> None:
    """Give every live module the staging values after vLLM's post-load processing, in the live storage.

    Modules with a quantization method get copies of their staging parameters, run the method's
    ``process_weights_after_loading`` (the CPU MoE prepack needs ``moe_kernel`` reset, else vLLM treats the
    call as an update and skips it), and the processed tensors are copied into the original parameters,
    which are then put back (storage addresses never change). Other parameters (norms) are copied as they are.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    staged = dict(staging.named_modules())
    with set_current_vllm_config(vllm_config), torch.no_grad():
        for name, module in live.named_modules():
            source = staged.get(name)
            kernel = {k: v for k, v in module._parameters.items() if v is not None}
            if not kernel or source is None:
                continue
            method = getattr(module, "quant_method", None)
            if not isinstance(method, QuantizeMethodBase):
                for pname, p in kernel.items():
                    p.data.copy_(getattr(source, pname).data)
                continue
            for pname in kernel:
                sp = getattr(source, pname)
                fresh = nn.Parameter(sp.data.clone(), requires_grad=False)
                fresh.__dict__.update(sp.__dict__)
                module._parameters[pname] = fresh
            if hasattr(method, "moe_kernel"):
                method.moe_kernel = None
            if hasattr(module, "_already_called_process_weights_after_loading"):
                delattr(module, "_already_called_process_weights_after_loading")
            method.process_weights_after_loading(module)
            for pname, kp in kernel.items():
                new = getattr(module, pname)
                if new.shape != kp.shape or new.dtype != kp.dtype:
                    raise RuntimeError(
                        f"{name}.{pname}: processed {tuple(new.shape)} {new.dtype} vs live {tuple(kp.shape)} {kp.dtype}"
                    )
                kp.data.copy_(new.data)
                module._parameters[pname] = kp
