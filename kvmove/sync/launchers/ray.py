"""The Ray launcher: one Ray actor per rank, each holding the rank's host; actor calls carry the commands.

Ray is imported when this launcher starts, never when kvmove is imported. Locally, Ray is started on loopback;
with ``Placement.ray_address`` (``--ray-address``, or ``RAY_ADDRESS`` read at the CLI edge) the run joins that
cluster. The actor class mixes in ``ServesSlots`` so Ray-object transports (``rdt-*``, ``object-store``) work.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Sequence
from typing import Any

from kvmove.errors import KvmoveError
from kvmove.sync.config import Side, SyncConfig
from kvmove.sync.launchers.base import Call, Launcher, RankDied, RankHandle
from kvmove.sync.ranks.host import Host, RankSpec
from kvmove.transport import get_transport
from kvmove.transport.slots import ACTOR_OPTIONS, ServesSlots

MAX_CONCURRENCY = 64


def start_ray(address: str | None) -> Any:
    """Join the Ray cluster at ``address``, or start a local one that stays on loopback."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    local = is_loopback(address)
    if local:
        # NOTE: Ray resolves 127.0.0.1 to the machine's routable address unless it believes it runs on a
        # laptop; this flag (read by Ray's services at call time, and by the workers from the environment)
        # keeps a local run's every socket on loopback, and lets a driver reach a head started on loopback.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    if address:
        _probe(address)
    if local:
        ray_constants.ENABLE_RAY_CLUSTER = False
    if ray.is_initialized():
        return ray
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:  # "local": a new local instance, even where RAY_ADDRESS names another cluster
            ray.init(
                address="local",
                num_cpus=max(2, os.cpu_count() or 2),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                configure_logging=False,
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise KvmoveError(f"cannot reach a Ray cluster at {address or 'local'}: {exc}".splitlines()[0]) from None
    except Exception as exc:  # NOTE: Ray raises a bare Exception when its local node misses its start-up deadline
        ray.shutdown()
        raise KvmoveError(f"Ray could not start ({address or 'a local instance'}): {exc}".splitlines()[0]) from None
    return ray


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` (None: a new local Ray) is on this machine's loopback interface."""
    if not address:
        return True
    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _probe(address: str) -> None:
    """Fail fast (seconds, not Ray's minutes of retries) when nothing listens at ``host:port``."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            pass
    except (OSError, ValueError) as exc:
        raise KvmoveError(f"cannot reach a Ray cluster at {address}: {exc}") from None


class RankActor(ServesSlots):
    """A Ray actor holding one rank's host; ``handle`` is every command, ``invoke`` a host method (tests)."""

    def __init__(self, host_cls: type[Host], spec: RankSpec, *args: Any) -> None:
        self.host = host_cls(spec, *args)

    def handle(self, command: Any) -> Any:
        return self.host.handle(command)

    def invoke(self, method: str, *args: Any) -> Any:
        return getattr(self.host, method)(*args)


@functools.cache
def actor_class() -> Any:
    import ray

    return ray.remote(**ACTOR_OPTIONS)(RankActor)


class RayRank(RankHandle):
    def __init__(self, spec: RankSpec, actor: Any, ray: Any) -> None:
        super().__init__(spec)
        self.actor, self._ray = actor, ray
        self._killed = False

    def submit(self, command: Any) -> Call:
        return RayCall(self, command, self.actor.handle.remote(command))

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            self._ray.kill(self.actor, no_restart=True)


class RayCall(Call):
    def __init__(self, rank: RayRank, command: Any, ref: Any) -> None:
        super().__init__(rank, command)
        self.ref = ref


class RayLauncher(Launcher):
    """Ranks as Ray actors (see the module docstring)."""

    actors = True

    def __init__(self, config: SyncConfig) -> None:
        super().__init__(config)
        self.ray = start_ray(config.placement.ray_address)
        self.ranks: list[RayRank] = []

    def start(self, ranks: Sequence[tuple[type[Host], RankSpec]]) -> list[RankHandle]:
        cls = actor_class().options(num_cpus=0, max_concurrency=MAX_CONCURRENCY)
        started = [RayRank(spec, cls.remote(host, spec), self.ray) for host, spec in ranks]
        self.ranks += started
        return list(started)

    def started(self, ranks: Sequence[RankHandle]) -> None:
        backend = get_transport(self.config.transport).actor_group
        if backend is not None:
            from kvmove.transport.rdt import create_rdt_group

            create_rdt_group([r.actor for r in ranks if isinstance(r, RayRank)], backend)

    def wait(self, calls: Sequence[Call], timeout_s: float) -> list[Call]:
        by_ref = {c.ref: c for c in calls if isinstance(c, RayCall)}
        ready, _ = self.ray.wait(list(by_ref), num_returns=1, timeout=timeout_s)
        return [by_ref[r] for r in ready]

    def _fetch(self, call: Call) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        assert isinstance(call, RayCall)
        try:
            return self.ray.get(call.ref, timeout=0)
        except RayActorError as exc:
            if exc.actor_init_failed:  # its host raised while starting: say what it raised, in one line
                raise KvmoveError(f"{call.rank.label} could not start: {_last_error(str(exc))}") from None
            raise RankDied(f"{call.rank.label} died ({type(exc).__name__})") from None
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            if isinstance(cause, KvmoveError):
                raise cause from None
            first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise KvmoveError(f"{call.rank.label}: {type(cause).__name__}: {first[:500]}") from None

    def close(self) -> None:
        for rank in sorted(self.ranks, key=lambda r: r.spec.side is Side.TRAINER):
            rank.kill()
        self.ranks.clear()


def _last_error(text: str) -> str:
    """The message of the innermost exception of a remote traceback (its last ``...Error: message`` line)."""
    lines = [line.strip() for line in text.splitlines() if "Error: " in line]
    if not lines:
        return (text.strip().splitlines() or ["unknown error"])[-1][:500]
    kind, _, message = lines[-1].partition(": ")
    return message if kind.rsplit(".", 1)[-1] in _USER_ERRORS else f"{kind.rsplit('.', 1)[-1]}: {message}"[:500]


_USER_ERRORS = {"KvmoveError", "ModelError", "LayoutError", "PlanError", "MissingDependencyError"}
