"""A server's migration plane: one host KV endpoint per tensor-parallel rank (its host pool, transport and session
entry), the migration target and source over all of them, and the watchdog.

Lock order, everywhere: the target's table lock, then the worker's lock, then an endpoint's page-table lock. The
decode loop takes only the worker's lock, and never while a byte of a migration moves.

Peers: every address a migration names (a transfer's target, a pull's source) is a validated ``host:port`` (and,
with ``--allowed-peers``, an allowed one) before anything is sent to it; requests to peers carry this server's
peer key (its admin key, else its API key).
"""

from __future__ import annotations

import json
import socket
import threading

import httpx

from kvmove.migration.endpoint import HostEndpoint, TransportSetup
from kvmove.migration.errors import PeerUnreachableError, error_for_status, failure_message
from kvmove.migration.messages import PullKVReq, PullKVResp, RankSession, Topology, TransferSessionIds
from kvmove.migration.session import geometry_info
from kvmove.migration.share import PoolShare
from kvmove.migration.source import MigrationSource
from kvmove.migration.target import MigrationTarget
from kvmove.migration.watchdog import Watchdog
from kvmove.reference import RolloutWorker
from kvmove.server.auth import bearer
from kvmove.server.config import ServerConfig
from kvmove.transport.http_route import ReadAnswer


class MigrationPlane:
    def __init__(self, config: ServerConfig, worker: RolloutWorker, worker_lock: threading.RLock) -> None:
        self.config, self.worker = config, worker
        self.endpoints: list[HostEndpoint] = []
        setup = TransportSetup(config.url, bearer(config.keys.peer_key), config.host)
        try:
            for pool in worker.pools:
                self.endpoints.append(HostEndpoint(pool.geometry, config.num_host_pages, config.transport, setup))
        except BaseException:
            self.close()
            raise
        timeout, share = config.kv_migration_watchdog_timeout, PoolShare(config.migration_share, config.peer_share)
        self.target = MigrationTarget(worker, worker_lock, self.endpoints, timeout, peers=config.peers, share=share)
        self.source = MigrationSource(
            worker, worker_lock, self.endpoints, self.rank_sessions, self.send_pull, peers=config.peers, share=share
        )
        self.watchdog = Watchdog(self.target, config.watchdog_interval)
        # NOTE: one client for every pull request: a fresh one per call builds an SSL context (~50-80 ms here)
        nodelay = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        headers = bearer(config.keys.peer_key)
        self._http = httpx.Client(timeout=config.peer_timeout, transport=nodelay, headers=headers)

    @property
    def endpoint(self) -> HostEndpoint:
        """Rank 0's endpoint (its transport choice is the server's)."""
        return self.endpoints[0]

    def rank_sessions(self) -> list[RankSession]:
        """Every rank's session entry: its host buffers and the KV heads it holds; one address, the server's."""
        return [
            RankSession(
                tp=r,
                pp=0,
                session_id=self.config.session_id,
                host_kv_data_ptrs=e.handles(),
                host_kv_item_lens=e.pool.item_lens(),
                geometry=geometry_info(e.pool.geometry),
                weight_version=self.worker.weight_version,
                transport=e.transport_name,
            )
            for r, e in enumerate(self.endpoints)
        ]

    def session_ids(self) -> TransferSessionIds:
        topology = Topology(tp_size=len(self.endpoints), pp_size=1, page_size=self.config.page_size)
        return TransferSessionIds(topology=topology, ranks=self.rank_sessions())

    def read_pages(self, body: bytes) -> ReadAnswer:
        """A peer's read of host pages one of this server's ranks offered it (the ``http`` data plane)."""
        name = _read_endpoint(body)
        endpoint = next((e for e in self.endpoints if e.transport.endpoint == name), self.endpoints[0])
        return endpoint.serve(body)  # NOTE: a body naming no rank here gets rank 0's refusal

    def send_pull(self, session_id: str, body: PullKVReq) -> PullKVResp:
        url = self.config.peers.check(session_id).url("/kvmove/pull_kv")
        try:
            resp = self._http.post(url, json=body.model_dump())
        except httpx.HTTPError as exc:
            raise PeerUnreachableError(f"target {session_id} unreachable: {exc}") from exc
        if resp.status_code != 200:
            raise error_for_status(resp.status_code, f"target {session_id}: {_message(resp)}")
        return PullKVResp.model_validate(resp.json())

    def check_owned(self) -> None:
        """Every rank's host pages owned by a migration or a transfer; call under ``target.locked()``."""
        for r, endpoint in enumerate(self.endpoints):
            endpoint.check_owned(self.target.host_pages_in_use(r))

    @property
    def host_free_pages(self) -> int:
        return min(e.pool.free_pages for e in self.endpoints)

    @property
    def open_grants(self) -> int:
        return sum(e.open_grants for e in self.endpoints)

    @property
    def host_used_pages(self) -> int:
        return sum(e.pool.used_pages for e in self.endpoints)

    @property
    def staged_pages(self) -> int:
        return sum(e.staged_pages for e in self.endpoints)

    def close(self) -> None:
        if hasattr(self, "_http"):
            self._http.close()
        for endpoint in self.endpoints:
            endpoint.close()


def _read_endpoint(body: bytes) -> str | None:
    try:
        name = json.loads(body).get("endpoint")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _message(resp: httpx.Response) -> str:
    return failure_message(resp.status_code, resp.reason_phrase, resp.content)
