"""The in-process bridge between a kvmove engine actor and the ``kvmove`` backend inside its vLLM worker.

The actor runs vLLM in-process (one EngineCore, the ``uni`` executor), so the weight-transfer engine vLLM
creates lives in the actor's own process. The actor opens a :class:`Session` under a key and passes the key in
``init_info``; the engine attaches the live model, the staging model and vLLM's own loader to it; every
``update_weights`` then calls back into the actor's puller, which moves bytes into the staging tensors.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvmove.errors import KvmoveError


@dataclass
class Session:
    """One vLLM engine replica's shared state (see module docstring)."""

    key: str
    live: nn.Module | None = None
    staging: nn.Module | None = None
    reference: Callable[[Iterable[tuple[str, torch.Tensor]]], nn.Module] | None = None
    """Build a fresh vLLM model, run vLLM's loader over the given weights and its post-load processing."""
    puller: Callable[[dict[str, Any]], Any] | None = None
    """Set by the actor: runs one sync's pulls into the staging tensors (update info -> engine stats)."""
    last_stats: Any = None
    finish_seconds: float = 0.0
    log: list[str] = field(default_factory=list)

    def require(self) -> tuple[nn.Module, nn.Module]:
        if self.live is None or self.staging is None:
            raise KvmoveError(f"vLLM session {self.key}: init_weight_transfer_engine has not run")
        return self.live, self.staging


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
        raise KvmoveError(
            f"no kvmove session {key!r} in this process: the kvmove backend must run inside the engine actor's "
            "process (vLLM in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend='uni')"
        )
    return found
