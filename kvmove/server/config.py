"""Configuration of one kvmove server (one rollout worker of ``tp_size`` tensor-parallel ranks, pp = 1), built once
at the CLI edge."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.errors import KvmoveError
from kvmove.migration.peers import PeerAddress, PeerPolicy
from kvmove.server.auth import ApiKeys

LOOPBACK = "127.0.0.1"
DTYPES = ("float32", "bfloat16")
SECRET_FIELDS = ("api_key", "admin_api_key")
"""Fields never put on a command line (``launch.spawn`` passes them in the environment)."""


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
        PeerAddress.parse(f"{self.host}:{self.port or 1}")  # NOTE: the host becomes this rank's session id
        PeerPolicy.of(self.allowed_peers)

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
        return ApiKeys(self.api_key or None, self.admin_api_key or None)

    @property
    def peers(self) -> PeerPolicy:
        return PeerPolicy.of(self.allowed_peers)
