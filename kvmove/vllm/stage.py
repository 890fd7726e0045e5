"""A vLLM worker's staging, built at ``init_weight_transfer_engine`` from the live model and the meta-device one.

Which parameters are staged is decided per module, from what vLLM's post-load processing does to it here
(:data:`IDENTITY`, model knowledge as data): a module without a quant method (norms) keeps what the loader wrote,
and so do unquantized linears and embeddings on CUDA; everything else (CPU-packed linears and embeddings, MoE
experts everywhere, quantized layers) is staged, and so is any parameter whose live shape or dtype is not the
unprocessed one. :class:`Staging` wires the window (kvmove.vllm.receiver) to vLLM: a unit's commit
processes each module owning its parameters from the staged tensors and commits it (kvmove.vllm.update),
a partial unit is first filled from the live model, and every commit is measured (:class:`Ledger`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.planning.recording import replay
from kvmove.vllm.receiver import Stager, Window
from kvmove.vllm.session import BackendError, Memory
from kvmove.vllm.staging import Budget, check_received, describe, staging_units, unit_key, window_layout
from kvmove.vllm.update import commit, fill_unit, live_value, owners, process_module

IDENTITY: dict[str, frozenset[str]] = {
    "cuda": frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}),
}
"""Per device type: quant methods whose post-load processing leaves the loaded parameters as they are (there, the
received bytes land in the live parameters directly)."""


def staged_params(live: nn.Module, meta: nn.Module, plan: ShardingPlan, device: str) -> frozenset[str]:
    """The plan's parameters that must be staged and processed before they serve (see the module docstring)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    live_params = dict(live.named_parameters(remove_duplicate=False))
    keeps = IDENTITY.get(device, frozenset())
    out: set[str] = set()
    for module, local in owners(meta, [p.name for p in plan.params]).items():
        method = getattr(live.get_submodule(module), "quant_method", None)
        processed = isinstance(method, QuantizeMethodBase) and type(method).__name__ not in keeps
        out |= {full for full in local.values() if processed}
    for p in plan.params:
        got = live_params.get(p.name)
        if got is None or tuple(got.shape) != p.shape or got.dtype != p.dtype:
            out.add(p.name)
    return frozenset(out)


@dataclasses.dataclass
class Ledger:
    """The engine side's extra memory of one update: the window, the receive slots, and the largest processed
    tensors of one module awaiting their commit."""

    window: int = 0
    recv: int = 0
    process: int = 0
    budget: int = 0
    probe: Callable[[str], None] | None = None
    """Called after each module's processing, before its commit (the memory tests measure there)."""

    def memory(self) -> Memory:
        return Memory(self.window + self.recv + self.process, self.budget, self.window, self.recv, self.process)


class Staging:
    """One worker's staged commits into ``live`` (see the module docstring)."""

    def __init__(
        self, live: nn.Module, meta: nn.Module, plan: ShardingPlan, vllm_config: Any, device: Any, budget: Budget
    ) -> None:
        self.live, self.meta, self.plan, self.vllm_config, self.budget = live, meta, plan, vllm_config, budget
        units = staging_units(plan.params, plan.staged)
        window = Window(window_layout(units, plan.params), plan.params, device)
        self.owners = owners(meta, plan.staged)
        self.modules: dict[str, list[str]] = {}
        for module, local in self.owners.items():
            unit = next(unit_key(full) for full in local.values())
            self.modules.setdefault(unit, []).append(module)
        live_params = dict(live.named_parameters(remove_duplicate=False))
        direct = {p.name: live_params[p.name].data for p in plan.params if p.name not in plan.staged}
        self.stager = Stager(window, direct, self._commit, self._fill)
        self.ledger = Ledger(window.nbytes, budget=budget.nbytes)

    def _commit(self, unit: str, views: Mapping[str, torch.Tensor]) -> None:
        live_modules, meta_modules = dict(self.live.named_modules()), dict(self.meta.named_modules())
        window = self.stager.window.buffer.untyped_storage().data_ptr()
        for name in self.modules.get(unit, []):
            staged = {local: views[full] for local, full in self.owners[name].items()}
            update = process_module(name, live_modules[name], meta_modules[name], staged, self.vllm_config)
            fresh = sum(
                t.untyped_storage().nbytes()
                for t in update.tensors.values()
                if t.untyped_storage().data_ptr() != window
            )
            self.ledger.process = max(self.ledger.process, fresh)
            if self.ledger.probe is not None:
                self.ledger.probe(name)
            commit([update])

    def _fill(self, unit: str, views: Mapping[str, torch.Tensor]) -> None:
        mine = {m: self.owners[m] for m in self.modules.get(unit, [])}
        try:
            fill_unit(self.live, mine, views)
        except RuntimeError as exc:
            raise BackendError(str(exc)) from exc

    def fillable(self, param: str) -> bool:
        """Whether ``param``'s current unprocessed value can be read back from the live model."""
        for module, local_names in self.owners.items():
            for local, full in local_names.items():
                if full == param:
                    shape = self.stager.window.views[param].shape
                    return live_value(self.live, module, local, shape) is not None
        return False

    def validate(self, tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse an in-process update's ``tensors`` before anything changes (kvmove.vllm.staging)."""
        got = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
        problems = check_received(self.plan.regions, got, shapes, self.plan.staged, self.fillable)
        if problems:
            raise BackendError(f"kvmove: the update was refused, nothing changed: {describe(problems)}")

    def land(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """An in-process update's (validated) ``tensors``, landed region by region through the stager (a unit the
        update covers in part is filled from the live model first)."""
        regions = self.plan.regions
        layout = self.stager.window.layout
        mine = [r for r in regions if r.hf_name in tensors]
        expected: dict[str, int] = {}
        for r in mine:
            if (u := layout.unit_of(r.param)) is not None:
                expected[u] = expected.get(u, 0) + 1
        covered = {u: sum(1 for r in regions if layout.unit_of(r.param) == u) for u in expected}
        self.stager.begin(expected, frozenset(u for u, n in expected.items() if n < covered[u]))
        targets, order = self.stager.targets(), {u: i for i, u in enumerate(layout.units)}
        with torch.no_grad():
            for r in sorted(mine, key=lambda r: order.get(layout.unit_of(r.param) or "", -1)):
                unit = layout.unit_of(r.param)
                if unit is not None:
                    self.stager.enter(unit)
                r.dst.apply(targets[r.param]).copy_(replay(r.ops, tensors[r.hf_name]))
                if unit is not None:
                    self.stager.count(unit, 1)

    def memory(self, recv: int) -> Memory:
        self.ledger.window, self.ledger.recv = self.stager.window.nbytes, recv
        return self.ledger.memory()
