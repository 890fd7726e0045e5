"""An engine rank's side of the registry: register its plan by address, then pull with the PullerInit it fetches.

:class:`JoinInfo` is what the engine rank is told (a plain, JSON-safe dict on the wire: an inference engine's
init payload may travel over HTTP). :class:`FleetMember` opens the rank's own transport endpoint, registers the
plan its engine's loader recorded, and opens its puller from the published ``PullerInit`` on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.sync.embedded.registry import FetchPullerInit, Register, Registered
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.ranks.control import Address, EngineStats, PullerInit
from kvmove.sync.ranks.engine import EngineRank
from kvmove.sync.ranks.puller import Puller, open_puller
from kvmove.sync.ranks.wire import ControlClient
from kvmove.sync.strategies import Strategy
from kvmove.transport import Transport, get_transport

REGISTRY = "the kvmove trainer's engine registry"


@dataclass(frozen=True)
class JoinInfo:
    """What an engine rank needs to join: where the registry listens, the run's key, the transport, the deadline."""

    registry_host: str
    registry_port: int
    authkey: str
    """The run's secret, hex (control connections authenticate with it)."""
    transport: str
    deadline_s: float = 60.0

    @property
    def registry(self) -> Address:
        return Address(self.registry_host, self.registry_port)

    @property
    def key(self) -> bytes:
        return bytes.fromhex(self.authkey)

    def payload(self) -> dict[str, Any]:
        """The init payload an engine is handed (plain JSON types)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def check_transport(name: str) -> type[Transport]:
    """The transport an engine rank can open on its own (no fixed group, no Ray actor), or a clear error."""
    cls = get_transport(name, actors=False)
    if cls.group_member or cls.needs_actor:
        need = "one fixed group of every rank" if cls.group_member else "Ray actors"
        raise KvmoveError(
            f"transport {cls.name!r} needs {need}; engine ranks that register by address open their own "
            "endpoint: use nixl (or http)"
        )
    return cls


@dataclass(frozen=True)
class Seat:
    """Where an engine rank sits: its replica (a key the replica's ranks share) and its rank within it."""

    replica: str
    local: int = 0
    tp: int = 1


class FleetMember:
    """One registered engine rank serving ``model``: ``target``'s parameters are what its ``plan`` fills."""

    def __init__(
        self,
        join: JoinInfo,
        seat: Seat,
        model: ModelConfig,
        target: nn.Module,
        plan: ShardingPlan,
        device: str | torch.device = "cpu",
        rank: Any = EngineRank,
    ) -> None:
        """``rank``: builds the receiving side of the puller (kvmove.sync.ranks.puller.open_puller)."""
        self.join, self.target, self.plan, self.device, self.rank = join, target, plan, device, rank
        self.transport = check_transport(join.transport).open(None, str(device))
        self._puller: Puller | None = None
        try:
            info = self.transport.endpoint_info()
            reply: Registered = self._call(Register(seat.replica, seat.local, seat.tp, model, plan, info, os.getpid()))
        except BaseException:
            self.transport.close()
            raise
        self.ticket = reply.ticket

    def puller(self) -> Puller:
        """This rank's puller (the PullerInit is fetched, and the receive side registered, on first use)."""
        if self._puller is None:
            init: PullerInit = self._call(FetchPullerInit(self.ticket, self.join.deadline_s))
            self._puller = open_puller(
                init, self.target, self.plan, transport=self.transport, device=self.device, rank=self.rank
            )
        return self._puller

    def run(self, sync_id: int, strategy: Strategy, delay_s: float = 0.0, pulled: Any = None) -> EngineStats:
        """One sync's pulls into ``target``."""
        with torch.no_grad():
            return self.puller().run(sync_id, strategy, delay_s, pulled)

    def _call(self, command: Any) -> Any:
        client = ControlClient(self.join.registry, self.join.key, REGISTRY, self.join.deadline_s + 10)
        try:
            return client.call(command)
        finally:
            client.close()

    def close(self) -> None:
        """Close the control links and the transport endpoint (its registrations go with it); idempotent."""
        if self._puller is not None:
            self._puller.close()
            self._puller = None
        self.transport.close()
