"""The control plane's typed messages: every command a rank answers, and every reply (the contract).

A rank is a *host* object in its own process (``kvmove.sync.ranks.host``); it answers commands whoever sends
them: the driver through a launcher (Ray actor calls, or TCP for plain processes), and engine ranks, which reach
trainer ranks **by address** (:class:`Pack`, :class:`Finish` over ``kvmove.sync.ranks.wire``) from any process,
Ray actor or not. Commands are frozen dataclasses; replies are NamedTuples, the ranks' stats, or None.
Bytes never travel here: they move through the transport between registered buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from kvmove.sync.planning.blueprint import PullSpecs, TrainerSync
from kvmove.sync.planning.direct import ArenaLayout
from kvmove.sync.planning.plan import Box, ShardingPlan
from kvmove.sync.planning.schedule import PullPlan
from kvmove.sync.ranks.calltimes import CallTimes
from kvmove.sync.strategies import Strategy
from kvmove.sync.verify import VerifyResult as VerifyResult  # the engine ranks' verification reply
from kvmove.transport import BufferDesc, EndpointInfo, Membership


class Command:
    """Base of every command; ``wants_reply`` False marks a note (sent, never answered)."""

    wants_reply: ClassVar[bool] = True


# -- replies ----------------------------------------------------------------------------------------------------
class Address(NamedTuple):
    host: str
    port: int


class Failure(NamedTuple):
    """On the wire instead of a reply when the handler raised; ``user`` marks a KvmoveError (a one-line message)."""

    kind: str
    message: str
    user: bool


class TrainerHello(NamedTuple):
    """Init step 1: a trainer rank's process, control address, raw shards and (if its source has one) arena."""

    rank: int
    pid: int
    control: Address
    shards: tuple[tuple[str, Box], ...]
    arena: ArenaLayout | None


class TrainerEndpoint(NamedTuple):
    """What an engine rank needs to read a trainer rank's bytes: its endpoint, serve slots and arena."""

    info: EndpointInfo
    slots: dict[str, list[BufferDesc]]
    arena: BufferDesc | None


class Packed(NamedTuple):
    """A packed pull is ready: ``nbytes`` of serve slot ``slot``."""

    slot: int
    nbytes: int
    encoding: str = "dense"
    """How the payload is encoded (``kvmove.sync.delta.encoding.Encoding``): dense, or a delta of it."""
    changed: int = 0
    """Words of the payload that changed (a delta's entries)."""


class PlanReport(NamedTuple):
    """Init step 3: an engine rank's sharding plan, made by a dry run of its own loader."""

    plan: ShardingPlan
    seconds: float
    pid: int


class TrainerStats(NamedTuple):
    rank: int
    seconds: float
    gather_seconds: float
    pack_seconds: float
    wait_seconds: float
    bytes_served: int
    pulls_served: int
    peak_extra_bytes: int
    collectives: int
    rss_bytes: int = 0
    cpu_seconds: float = 0.0
    """CPU seconds this rank's process spent (every thread) while it ran its part of the sync."""
    send_calls: CallTimes = CallTimes()
    """A broadcast's root: its sends, one per tensor (bytes and seconds, summed for a least-squares line)."""
    delta: dict[str, int] = {}  # noqa: RUF012 - NamedTuple defaults are never mutated
    """Delta syncs: the counters of ``kvmove.sync.delta.detect.Images`` (dense and sent bytes, pulls per
    encoding, changed and compared words per region class); empty otherwise."""


class EngineStats(NamedTuple):
    rank: int
    seconds: float
    request_seconds: float
    transfer_seconds: float
    load_seconds: float
    bytes_received: int
    pulls: int
    peak_extra_bytes: int
    rss_bytes: int = 0
    copy_executors: dict[str, int] = {}  # noqa: RUF012 - NamedTuple defaults are never mutated
    """Bytes this rank's transport moved per copy executor during the sync (``Transport.take_executed``)."""
    cpu_seconds: float = 0.0
    """CPU seconds this rank's process spent (every thread) while it ran its part of the sync."""


class RankMemory(NamedTuple):
    """Resident memory of one rank's process, now and at its peak."""

    side: str
    rank: int
    pid: int
    rss_bytes: int
    peak_rss_bytes: int


class Sampling(NamedTuple):
    """How an engine decodes a rollout (``temperature`` 0: greedy); ``seed`` makes sampling repeatable."""

    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None


class Completion(NamedTuple):
    """One decoded continuation of a token-id prompt, with the engine's log-probability of each sampled token."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


# -- what an engine rank needs to pull, without Ray (a picklable init info) ---------------------------------
class TrainerLink(NamedTuple):
    """One source trainer rank as an engine rank reaches it: control address (pack requests, finish notes)
    and transport endpoint (bytes)."""

    control: Address
    endpoint: TrainerEndpoint


@dataclass(frozen=True)
class PullerInit:
    """Everything one engine rank needs to pull from the trainer ranks, in any process (init step 5).

    ``kvmove.sync.ranks.puller.open_puller`` turns it into a puller; nothing in it needs Ray.
    """

    engine: int
    transport: str
    trainers: dict[int, TrainerLink]
    authkey: bytes
    pulls: dict[str, PullPlan]
    """Strategy name -> this engine rank's pulls."""
    recv_sizes: dict[str, tuple[int, int]]
    """Strategy name -> (receive slot count, slot bytes)."""
    direct_params: tuple[str, ...]
    """Parameters some direct pull writes (registered with the transport once)."""
    deadline_s: float = 60.0
    membership: Membership | None = None
    """The engine's place in the transport's group, for a process that opens its own transport endpoint."""


@dataclass(frozen=True)
class BroadcastGroup:
    """The broadcast baseline's process group: trainer rank 0 is member 0, live engine ranks 1..size-1."""

    store: Address
    size: int
    prefix: str


# -- engine rank -> trainer rank (by address) ---------------------------------------------------------------
@dataclass(frozen=True)
class Pack(Command):
    """Pack pull ``pull_id`` of ``engine`` into a free serve slot once its group is materialized -> Packed."""

    sync_id: int
    strategy: str
    engine: int
    pull_id: int
    timeout_s: float
    dense: bool = False
    """Serve the whole payload, whatever a delta sync would choose: the engine cannot land a delta of this pull
    (``kvmove.sync.transforms.Lander.accepts_delta``); the trainer's image of it is refreshed."""


@dataclass(frozen=True)
class Finish(Command):
    """Note: ``engine`` read ``slot`` (free again) and has all it pulls of ``group`` from this trainer rank."""

    wants_reply = False
    sync_id: int
    strategy: str
    group: int
    engine: int
    slot: int
    read_s: float = -1.0
    """Seconds the engine's read of the slot took (0: nothing to read; -1: not measured): what a delta sync
    weighs a pull's deltas against its dense syncs by (``kvmove.sync.delta.detect.Costs``)."""


# -- driver -> trainer rank ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PickAddress(Command):
    """A free port on this rank's host (trainer rank 0 hosts the trainer collectives' store) -> Address."""


@dataclass(frozen=True)
class HostBroadcastStore(Command):
    """Open the broadcast group's store now, on a free port of this rank's host (trainer rank 0, member 0, hosts
    it) -> Address: the group's members then connect to a store that is already listening (one that came up after
    them would keep a member waiting out the store client's retry, some 0.3-0.5 s)."""


@dataclass(frozen=True)
class OpenSource(Command):
    """Build this rank's WeightSource (its collectives meet at ``store``) -> TrainerHello (init step 1)."""

    store: Address


@dataclass(frozen=True)
class OpenSlots(Command):
    """Allocate and register ``count`` serve slots of ``nbytes`` per strategy, and the arena -> TrainerEndpoint."""

    sizes: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ConnectPeers(Command):
    """Connect this rank's transport endpoint to ``peers`` (two-sided transports: servers reach readers)."""

    peers: tuple[EndpointInfo, ...]


@dataclass(frozen=True)
class RegisterPulls(Command):
    """Cache what ``engine`` will ask this rank to pack under ``strategy``."""

    strategy: str
    engine: int
    specs: PullSpecs


@dataclass(frozen=True)
class ForgetEngine(Command):
    engine: int


@dataclass(frozen=True)
class StepWeights(Command):
    """Bring the weights of training step ``version`` into place (``WeightSource.step``)."""

    version: int


@dataclass(frozen=True)
class TrainStep(Command):
    """One training step of this rank's trainer on ``batch`` (``WeightSource.train``; an RL loop's rollouts)
    -> what the source reports (its loss)."""

    batch: Any


@dataclass(frozen=True)
class RunSync(Command):
    """This rank's loop for one sync -> TrainerStats. ``die_after_groups``: fault injection (the process dies
    once that many groups were published)."""

    sync: TrainerSync
    die_after_groups: int | None = None


@dataclass(frozen=True)
class EngineGone(Command):
    """Stop waiting for ``engine`` (dead or dropped) in sync ``sync_id``."""

    sync_id: int
    engine: int


@dataclass(frozen=True)
class SendBroadcast(Command):
    """Baseline: every full tensor gathered onto rank 0, which broadcasts it -> TrainerStats."""

    group: BroadcastGroup
    die_after_groups: int | None = None


# -- driver -> engine rank ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildPlan(Command):
    """Dry-run this engine's own loader over recording tensors -> PlanReport (init step 3)."""


@dataclass(frozen=True)
class OpenPuller(Command):
    """Register receive slots and direct-pull parameters, connect to the source trainer ranks -> EndpointInfo."""

    init: PullerInit


@dataclass(frozen=True)
class RunPulls(Command):
    """This rank's pulls of one sync -> EngineStats. ``delay_s``: a straggler's sleep before each group;
    ``die_after_pulls``: fault injection (the process dies once that many pulls finished)."""

    sync_id: int
    strategy: Strategy
    delay_s: float = 0.0
    die_after_pulls: int | None = None


@dataclass(frozen=True)
class ReceiveBroadcast(Command):
    """Baseline: receive every full tensor as member ``member`` of ``group``, load it -> EngineStats."""

    group: BroadcastGroup
    member: int


@dataclass(frozen=True)
class VerifyWeights(Command):
    """Check this rank's parameters bit-exact against the weights of ``version`` -> VerifyResult."""

    version: int
    seed: int


@dataclass(frozen=True)
class MeasureCopy(Command):
    """Copy ceiling of this run's link: GB/s of a ``nbytes`` copy from ``source`` to this rank's device -> float."""

    source: str
    nbytes: int


# -- any rank -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReportMemory(Command):
    """-> RankMemory of this rank's process."""
