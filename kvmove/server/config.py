"""Configuration of one kvmove server (one rollout worker of ``tp_size`` tensor-parallel ranks, pp = 1), built once
at the CLI edge."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.errors import KvmoveError

LOOPBACK = "127.0.0.1"


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

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise KvmoveError(f"port must be in [0, 65536), got {self.port}")
        if self.kv_migration_watchdog_timeout <= 0 or self.watchdog_interval <= 0:
            raise KvmoveError("the watchdog timeout and interval must be > 0 seconds")
        if self.tp_size < 1:
            raise KvmoveError(f"tp size must be >= 1, got {self.tp_size}")

    @property
    def session_id(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.session_id}"

    @property
    def num_host_pages(self) -> int:
        return self.host_pages or self.num_pages
