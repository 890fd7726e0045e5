"""The engine registry: engine ranks come to the trainer side by address, each with its own plan.

An engine rank sends :class:`Register` (who it is within its replica, the model it serves, the plan recorded by a
dry run of its own loader, its transport endpoint) and gets a ticket. Once every engine the owner waits for is in,
the owner closes the registration into a :class:`Fleet` (engine ranks numbered, plans checked to agree), derives
the blueprint from it, and publishes one ``PullerInit`` per ticket; each engine rank fetches its own
(:class:`FetchPullerInit`, which waits until it is published). The registry answers on its own authenticated
control server, so engine ranks reach it from any process, whatever started them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.layout import EngineLayout
from kvmove.sync.planning.plan import ShardingPlan
from kvmove.sync.ranks.control import Address, Command, PullerInit
from kvmove.sync.ranks.wire import ControlServer
from kvmove.transport import EndpointInfo


@dataclass(frozen=True)
class Register(Command):
    """An engine rank joins -> :class:`Registered`. ``replica`` is a key its replica's ranks share."""

    replica: str
    local: int
    """Rank within its replica (vLLM: the worker's rank in its engine's tensor-parallel world)."""
    tp: int
    """Ranks per replica (tensor-parallel size)."""
    model: ModelConfig
    plan: ShardingPlan
    endpoint: EndpointInfo
    pid: int


class Registered(NamedTuple):
    ticket: int


@dataclass(frozen=True)
class FetchPullerInit(Command):
    """The PullerInit of ``ticket``, once the registry's owner published it (waits up to ``timeout_s``)."""

    ticket: int
    timeout_s: float


class Member(NamedTuple):
    """One registered engine rank."""

    ticket: int
    register: Register


class Fleet(NamedTuple):
    """The engine ranks of a closed registration: engine rank ``e`` is ``members[e]``."""

    model: ModelConfig
    layout: EngineLayout
    members: tuple[Member, ...]
    plans: tuple[ShardingPlan, ...]
    """By local rank (replicas agree on them)."""


class EngineRegistry:
    """Registrations and published PullerInits, served at ``address`` (see the module docstring)."""

    def __init__(self, authkey: bytes, host: str) -> None:
        self._cond = threading.Condition()
        self._members: list[Member] = []
        self._inits: dict[int, PullerInit] = {}
        self._closed = False
        self._server = ControlServer(self.handle, host, authkey)

    @property
    def address(self) -> Address:
        return self._server.address

    def handle(self, command: Any) -> Any:
        if isinstance(command, Register):
            return self._register(command)
        if isinstance(command, FetchPullerInit):
            return self._fetch(command)
        raise KvmoveError(f"the engine registry answers Register and FetchPullerInit, not {type(command).__name__}")

    def _register(self, command: Register) -> Registered:
        with self._cond:
            if self._closed:
                raise KvmoveError(
                    "this trainer's engine registration is closed (its engines were fixed at trainer init): "
                    "init the trainer side again to add engines"
                )
            ticket = len(self._members)
            self._members.append(Member(ticket, command))
            self._cond.notify_all()
            return Registered(ticket)

    def members(self) -> list[Member]:
        with self._cond:
            return list(self._members)

    def close(self) -> Fleet:
        """Close the registration: every engine rank numbered (replicas in order of arrival), checked to agree."""
        with self._cond:
            self._closed = True
            members = list(self._members)
        return fleet_of(members)

    def publish(self, ticket: int, init: PullerInit) -> None:
        with self._cond:
            self._inits[ticket] = init
            self._cond.notify_all()

    def _fetch(self, command: FetchPullerInit) -> PullerInit:
        deadline = time.monotonic() + command.timeout_s
        with self._cond:
            while command.ticket not in self._inits:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KvmoveError(
                        f"the trainer side published no pull plan for engine ticket {command.ticket} within "
                        f"{command.timeout_s:.0f} s (its init did not finish, or this engine registered late)"
                    )
                self._cond.wait(min(left, 0.5))
            return self._inits[command.ticket]

    def shutdown(self) -> None:
        self._server.close()


def fleet_of(members: list[Member]) -> Fleet:
    """Number the registered ranks and check they form whole, identical replicas of one model."""
    if not members:
        raise KvmoveError(
            "no engine rank registered: init_weight_transfer_engine did not reach any engine worker "
            "(is the engine started with weight_transfer_config={'backend': 'kvmove'}?)"
        )
    first = members[0].register
    replicas: dict[str, dict[int, Member]] = {}
    for m in members:
        r = m.register
        if dataclasses.replace(r.model, name="") != dataclasses.replace(first.model, name=""):
            raise KvmoveError(f"engine replicas serve different models ({first.model.name} and {r.model.name})")
        if r.tp != first.tp:
            raise KvmoveError(f"engine replicas differ in tensor-parallel size ({first.tp} and {r.tp})")
        ranks = replicas.setdefault(r.replica, {})
        if r.local in ranks or not 0 <= r.local < r.tp:
            raise KvmoveError(f"engine rank {r.local} of replica {r.replica} registered twice or out of 0..{r.tp - 1}")
        ranks[r.local] = m
    for key, ranks in replicas.items():
        if len(ranks) != first.tp:
            raise KvmoveError(f"engine replica {key} registered {len(ranks)} of its {first.tp} ranks")
    ordered = tuple(ranks[local] for ranks in replicas.values() for local in range(first.tp))
    plans = tuple(ordered[local].register.plan for local in range(first.tp))
    for m in ordered:
        if m.register.plan.regions != plans[m.register.local].regions:
            raise KvmoveError(f"engine replicas disagree on the plan of local rank {m.register.local}")
    return Fleet(first.model, EngineLayout(tp=first.tp, replicas=len(replicas)), ordered, plans)
