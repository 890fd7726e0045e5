"""A worker's kvmove session: what the ``kvmove`` backend inside one vLLM worker holds, in the worker's process.

``init_weight_transfer_engine`` opens a :class:`Session` and attaches the live model, the staging model and vLLM's
own loader to it; with the trainer's join info (what kvmove's trainer engine and kvmove's own engine host send)
the worker then builds its own puller (``kvmove.engines.vllm.join``) and records the join info in ``joined``.
Every ``update_weights`` calls the puller, which moves bytes into the staging tensors and says which checkpoint
tensors it delivered (:class:`Received`). ``shutdown_weight_transfer_engine`` closes the session: its transfer
resources are released and it leaves the process's table.

A caller in the worker's own process (vLLM in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) may instead open a
session itself, pass its key in ``init_info`` and attach its own puller: the backend's tests do, to feed chosen
tensors. Nothing of kvmove's engines uses that.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout
from kvmove.models.config import ModelConfig
from kvmove.sync.planning.plan import ShardingPlan, SourceTensors


class BackendError(KvmoveError, RuntimeError):
    """Misuse of the ``kvmove`` backend (a RuntimeError, as vLLM raises for misuse of its weight-update calls)."""


class Received(NamedTuple):
    """What one ``update_weights`` delivered into the staging model."""

    stats: Any
    """The puller's own report (kvmove's engine stats for a sync)."""
    tensors: frozenset[str]
    """The checkpoint (HF) tensors whose bytes now sit in the staging model."""


@dataclass
class Session:
    """One vLLM engine replica's shared state (see module docstring)."""

    key: str
    live: nn.Module | None = None
    staging: nn.Module | None = None
    reference: Callable[[Iterable[tuple[str, torch.Tensor]]], nn.Module] | None = None
    """Build a fresh vLLM model, run vLLM's loader over the given weights and its post-load processing."""
    plan: ShardingPlan | None = None
    """The dry run of vLLM's loader on the staging model: which staging bytes each checkpoint tensor fills."""
    puller: Callable[[dict[str, Any]], Received] | None = None
    """Set by the actor: runs one sync's pulls into the staging tensors."""
    release: Callable[[], None] | None = None
    """Set by the actor: frees what its pulls hold (registrations of the staging tensors, connections)."""
    joined: Any = None
    """The trainer's join info (kvmove.sync.embedded.member.JoinInfo) the worker's puller was built from; None
    for a session whose puller an in-process caller attached."""
    last_stats: Any = None
    finish_seconds: float = 0.0
    log: list[str] = field(default_factory=list)

    def require(self) -> tuple[nn.Module, nn.Module]:
        if self.live is None or self.staging is None:
            raise BackendError(f"vLLM session {self.key}: init_weight_transfer_engine has not run")
        return self.live, self.staging

    def require_plan(self) -> ShardingPlan:
        if self.plan is None:
            raise BackendError(f"vLLM session {self.key}: no plan of the staging model yet (build it after init)")
        return self.plan

    def close(self) -> None:
        """Release the actor's transfer resources and drop every model reference; the session is unusable."""
        release, self.release = self.release, None
        self.live = self.staging = self.reference = self.plan = self.puller = self.joined = None
        self.last_stats = None
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
    staging: nn.Module,
    layout: EngineLayout | None = None,
    rank: int = 0,
    source: SourceTensors | None = None,
) -> ShardingPlan:
    """Dry-run vLLM's own ``load_weights`` over recording tensors on the (unprocessed) staging model; ``source``:
    the trainer's tensors and their conversion to HF (default: the HF checkpoint itself)."""
    from kvmove.engines import EngineAdapter
    from kvmove.sync.planning.plan import plan_rank

    adapter = EngineAdapter("vllm", lambda *_a, **_k: staging, lambda m, ws: m.load_weights(ws))  # type: ignore[operator]
    layout = layout or EngineLayout()
    return plan_rank(cfg, layout, layout.coord(rank), reuse=False, engine=adapter, source=source)
