"""A worker's kvmove session: what the ``kvmove`` backend inside one vLLM worker holds, in the worker's process.

``init_weight_transfer_engine`` opens a :class:`Session` and attaches the live model, a *meta-device* vLLM model of
the served config (no memory: the plan is recorded on it, and it keeps the attributes vLLM's loader gives the
unprocessed parameters), the staging window and its :class:`~kvmove.vllm.receiver.Stager`, and vLLM's own
loader (for ``--verify``). With the trainer's join info (what kvmove's trainer engine and kvmove's own engine host
send) the worker then builds its own puller (``kvmove.vllm.join``) and records the join info in ``joined``.
Every ``update_weights`` calls the puller, which lands checkpoint tensors in the live model or the window (each
complete unit is committed as it lands) and says which it delivered (:class:`Received`).
``shutdown_weight_transfer_engine`` closes the session: its transfer resources and window are released and it
leaves the process's table.

A caller in the worker's own process (vLLM in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) may instead open a
session itself, pass its key in ``init_info`` and attach its own puller, which hands the backend the tensors
themselves (``Received.payload``): the backend's tests do, to feed chosen tensors. Nothing of kvmove's engines
uses that.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout
from kvmove.sync.planning.plan import ShardingPlan, SourceTensors


class BackendError(KvmoveError, RuntimeError):
    """Misuse of the ``kvmove`` backend (a RuntimeError, as vLLM raises for misuse of its weight-update calls)."""


class Received(NamedTuple):
    """What one ``update_weights`` delivered."""

    stats: Any
    """The puller's own report (kvmove's engine stats for a sync)."""
    tensors: frozenset[str]
    """The checkpoint (HF) tensors whose bytes the update carried."""
    payload: Any = None
    """An in-process puller's tensors themselves (HF name -> tensor), for the backend to validate and land; None
    where the puller landed them (kvmove's)."""


class Memory(NamedTuple):
    """The engine side's extra memory of the last update (what ``peak_extra_bytes`` reports)."""

    peak_extra_bytes: int
    """Window + receive slots + the largest module's processed tensors awaiting their commit."""
    budget_bytes: int
    """The staging budget (0: none set, the window is what the landing order needs)."""
    window_bytes: int
    recv_bytes: int
    process_bytes: int
    """The largest processed tensors of one module before its commit replaced the live ones."""


@dataclass
class Session:
    """One vLLM engine replica's shared state (see module docstring)."""

    key: str
    live: nn.Module | None = None
    meta: nn.Module | None = None
    """The served model, unprocessed, on the meta device (no memory): planning and parameter attributes."""
    stager: Any = None
    """The staging window and its commits (kvmove.vllm.receiver.Stager)."""
    reference: Callable[[Iterable[tuple[str, torch.Tensor]]], nn.Module] | None = None
    """Build a fresh vLLM model, run vLLM's loader over the given weights and its post-load processing."""
    plan: ShardingPlan | None = None
    """The dry run of vLLM's loader on the meta model: which bytes each checkpoint tensor fills, and which
    parameters are staged (``ShardingPlan.staged``)."""
    puller: Callable[[dict[str, Any]], Received] | None = None
    """Set by the actor: runs one sync's pulls."""
    release: Callable[[], None] | None = None
    """Set by the actor: frees what its pulls hold (registrations, connections)."""
    joined: Any = None
    """The trainer's join info (kvmove.sync.embedded.member.JoinInfo) the worker's puller was built from; None
    for a session whose puller an in-process caller attached."""
    last_stats: Any = None
    finish_seconds: float = 0.0
    memory: Memory | None = None
    torn: str = ""
    """Set while an update has committed some units and not all (a failure half way): what to retry."""
    log: list[str] = field(default_factory=list)

    def require(self) -> nn.Module:
        """The live model (a BackendError before init)."""
        if self.live is None or self.meta is None:
            raise BackendError(f"vLLM session {self.key}: init_weight_transfer_engine has not run")
        return self.live

    def require_plan(self) -> ShardingPlan:
        if self.plan is None:
            raise BackendError(f"vLLM session {self.key}: no plan of the staging model yet (build it after init)")
        return self.plan

    def close(self) -> None:
        """Release the actor's transfer resources and drop every model reference; the session is unusable."""
        release, self.release = self.release, None
        self.live = self.meta = self.stager = self.reference = self.plan = self.puller = self.joined = None
        self.last_stats = self.memory = None
        if release is not None:
            release()


SESSIONS: dict[str, Session] = {}
# NOTE: reach SESSIONS only through these functions: Ray may pickle an actor class by value, and a dict the
# class referenced directly would arrive as a copy, unseen by the backend vLLM imports in the same process


def open_session() -> Session:
    """A new session, registered in this process."""
    s = Session(f"kvmove-{uuid.uuid4().hex[:12]}")
    SESSIONS[s.key] = s
    return s


def session(key: str) -> Session:
    found = SESSIONS.get(key)
    if found is None:
        raise BackendError(
            f"no kvmove session {key!r} in this process: a session key in init_info only names a session of the "
            "process the vLLM worker runs in (vLLM in-process); a trainer elsewhere sends its join info instead "
            "(kvmove's trainer engine, WeightTransferTrainerFactory.trainer_init, does), and a session ends at "
            "shutdown_weight_transfer_engine"
        )
    return found


def close_session(key: str) -> None:
    """Remove session ``key`` from this process's table and release it (nothing if it is gone already)."""
    found = SESSIONS.pop(key, None)
    if found is not None:
        found.close()


def staging_plan(
    cfg: ModelConfig,
    model: nn.Module,
    layout: EngineLayout | None = None,
    rank: int = 0,
    source: SourceTensors | None = None,
) -> ShardingPlan:
    """Dry-run vLLM's own ``load_weights`` over recording tensors on ``model`` (unprocessed; on the meta device);
    ``source``: the trainer's tensors and their conversion to HF (default: the HF checkpoint itself)."""
    from kvmove.engines import EngineAdapter
    from kvmove.sync.planning.plan import plan_rank

    adapter = EngineAdapter("vllm", lambda *_a, **_k: model, lambda m, ws: m.load_weights(ws))  # type: ignore[operator]
    layout = layout or EngineLayout()
    return plan_rank(cfg, layout, layout.coord(rank), reuse=False, engine=adapter, source=source)
