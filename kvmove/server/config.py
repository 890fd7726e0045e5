"""Configuration of one kvmove server (one rollout worker of ``tp_size`` tensor-parallel ranks, pp = 1), built once
at the CLI edge."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvmove.errors import KvmoveError
from kvmove.migration.peers import PeerAddress, PeerPolicy
from kvmove.server.auth import ApiKeys

LOOPBACK = "127.0.0.1"
DTYPES = ("float32", "bfloat16")
SECRET_FIELDS = ("api_key", "admin_api_key")
"""Fields never put on a command line (``launch.spawn`` passes them in the environment)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name) is this host's loopback only (``localhost``, 127.0.0.0/8, ``::1``)."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """``session_id`` (the rank's address in the migration handshake) is ``host:port`` of this HTTP server."""

    host: str = LOOPBACK
    port: int = 30000
    model: str = "qwen3-tiny"
    seed: int = 1
    num_pages: int = 128
    page_size: int = 16
    max_running: int = 16
    max_prefill_tokens: int = 2048
    dtype: str = "float32"
    weight_version: str = "0"
    enable_kv_migration: bool = False
    kv_migration_watchdog_timeout: float = 60.0
    watchdog_interval: float = 1.0
    host_pages: int = 0  # 0: as many as the device pool
    transport: str = "auto"  # KV data plane: auto (nixl where installed, else http), nixl or http
    max_body_bytes: int = 8 << 20
    peer_timeout: float = 60.0
    tp_size: int = 1
    kvmove_routes: bool = True  # False: only SGLang's routes and the fork's five migration routes (+ the data plane)
    handover_timeout: float = 600.0  # longest wait for a migrated request's answer from its target
    hold_timeout: float = 120.0  # a request held this long and never released resumes here (its controller died)
    api_key: str | None = None
    admin_api_key: str | None = None
    allowed_peers: tuple[str, ...] = ()  # session ids (host:port) of the only peers allowed; empty: any
    migration_share: float = 0.5  # most of the host (and device) pool one migration may hold
    peer_share: float = 0.5  # most of the host pool the migrations allocated by one client address may hold
    allow_user_migration: bool = False  # the API key opens the migration routes too when no admin key is set
    request_timeout: float = 0.0  # default deadline of a /generate request (seconds; 0: none)
    body_timeout: float = 30.0  # longest a request's body may take to arrive before the connection is closed
    keep_alive_timeout: int = 20  # seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive);
    # NOTE: longer than clients keep idle connections (httpx 5 s, aiohttp 15 s), or a request sent just as the server
    # closes one finds it gone ("Server disconnected without sending a response")
    max_connections: int = 2048  # concurrent connections/requests before new ones get 503 (uvicorn's limit_concurrency)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise KvmoveError(f"port must be in [0, 65536), got {self.port}")
        if self.kv_migration_watchdog_timeout <= 0 or self.watchdog_interval <= 0:
            raise KvmoveError("the watchdog timeout and interval must be > 0 seconds")
        if self.tp_size < 1:
            raise KvmoveError(f"tp size must be >= 1, got {self.tp_size}")
        if self.dtype not in DTYPES:
            raise KvmoveError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("migration_share", "peer_share"):
            if not 0 < getattr(self, name) <= 1:
                raise KvmoveError(f"{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}")
        if self.max_body_bytes < 1024 or min(self.peer_timeout, self.handover_timeout, self.hold_timeout) <= 0:
            raise KvmoveError("--max-body-bytes must be >= 1024 and the peer/hand-over/hold timeouts > 0 seconds")
        if self.request_timeout < 0 or self.body_timeout <= 0 or self.keep_alive_timeout < 1:
            raise KvmoveError("--request-timeout must be >= 0, --body-timeout > 0 and --keep-alive-timeout >= 1 s")
        if self.max_connections < 1:
            raise KvmoveError(f"--max-connections must be >= 1, got {self.max_connections}")
        PeerAddress.parse(f"{self.host}:{self.port or 1}")  # NOTE: the host becomes this rank's session id
        PeerPolicy.of(self.allowed_peers)
        self.check_exposure()

    def check_exposure(self) -> None:
        """KvmoveError if KV migration would be open to anyone who reaches a non-loopback ``host``: migration
        without an admin key binds loopback only, unless ``allow_user_migration`` says the user key may migrate."""
        if not self.enable_kv_migration or self.admin_api_key or self.allow_user_migration or is_loopback(self.host):
            return
        raise KvmoveError(
            f"--enable-kv-migration on {self.host} (not loopback) needs --admin-api-key: the migration and hold "
            "routes hand any request's prompt and outputs to their caller (--allow-user-migration lets the API "
            "key, or anyone without keys, call them)"
        )

    @property
    def session_id(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.session_id}"

    @property
    def num_host_pages(self) -> int:
        return self.host_pages or self.num_pages

    @property
    def keys(self) -> ApiKeys:
        return ApiKeys(self.api_key or None, self.admin_api_key or None, self.allow_user_migration)

    @property
    def peers(self) -> PeerPolicy:
        return PeerPolicy.of(self.allowed_peers)
