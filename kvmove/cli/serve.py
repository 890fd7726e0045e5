"""`kvmove serve`: one rollout worker behind SGLang-compatible HTTP routes, optionally with KV migration."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvmove.cli import streams
from kvmove.cli.options import KVTransport, ModelOpt
from kvmove.server.config import LOOPBACK, ServerConfig

if TYPE_CHECKING:
    from kvmove.migration.endpoint import TransportChoice

TransportOpt = Annotated[
    KVTransport,
    typer.Option(
        "--transport", help="KV data plane between servers: auto (nixl if installed, else http), nixl or http."
    ),
]


class Dtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


PortOpt = Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port to listen on (0: any free one).")]
HostOpt = Annotated[str, typer.Option("--host", help="Address to bind (loopback by default).")]
EnableKvMigrationOpt = Annotated[bool, typer.Option("--enable-kv-migration", help="Serve the KV-migration routes.")]
KvMigrationWatchdogTimeoutOpt = Annotated[
    float,
    typer.Option("--kv-migration-watchdog-timeout", help="Seconds before an uncommitted migration is rolled back."),
]
WatchdogIntervalOpt = Annotated[float, typer.Option("--watchdog-interval", help="Seconds between watchdog checks.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the model's random weights.")]
NumPagesOpt = Annotated[int, typer.Option("--num-pages", min=1, help="Device KV pool pages.")]
PageSizeOpt = Annotated[int, typer.Option("--page-size", min=1, help="Tokens per KV page.")]
HostPagesOpt = Annotated[int, typer.Option("--host-pages", min=0, help="Host KV pool pages (0: --num-pages).")]
MaxRunningOpt = Annotated[int, typer.Option("--max-running", min=1, help="Most requests in one batch.")]
MaxPrefillTokensOpt = Annotated[int, typer.Option("--max-prefill-tokens", min=1, help="Prefill budget per step.")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="KV and compute dtype.")]
WeightVersionOpt = Annotated[str, typer.Option("--weight-version", help="Namespace of cached K/V.")]
MaxBodyBytesOpt = Annotated[int, typer.Option("--max-body-bytes", help="Larger request bodies get 413.")]
PeerTimeoutOpt = Annotated[float, typer.Option("--peer-timeout", help="Seconds to wait for a peer server.")]

TpSizeOpt = Annotated[
    int,
    typer.Option(
        "--tp-size", "--tp", min=1, help="Tensor-parallel ranks (each its share of the KV heads and host pool)."
    ),
]
KvmoveRoutesOpt = Annotated[
    bool,
    typer.Option(
        "--kvmove-routes/--no-kvmove-routes",
        help="Serve kvmove's own control routes (hold/release, migration abort, integrity); off: only SGLang's "
        "routes and the fork's five migration routes.",
    ),
]

HandoverTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--handover-timeout", help="Seconds a migrated request may take on its target before it resumes here."
    ),
]
HoldTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--hold-timeout", help="Seconds a request held for migration may wait for its release before it resumes here."
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="KVMOVE_API_KEY",
        help="Key for every route but /health and /metrics (Authorization: Bearer KEY); SGLang's flag.",
    ),
]
AdminKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--admin-api-key",
        envvar="KVMOVE_ADMIN_API_KEY",
        help="Key for the admin routes (migration, hand-over, aborts, flush, data plane); peers present it to each "
        "other; SGLang's flag.",
    ),
]
AllowedPeersOpt = Annotated[
    str,
    typer.Option(
        "--allowed-peers",
        help="Comma-separated host:port of the only peer servers KV may move to or from (as they publish their "
        "session ids: their --host:--port); empty: any.",
    ),
]
MigrationShareOpt = Annotated[
    float, typer.Option("--migration-share", help="Most of the host pool one migration may hold (0-1].")
]
PeerShareOpt = Annotated[
    float,
    typer.Option(
        "--peer-share", help="Most of the host pool the pending migrations of one client address may hold (0-1]."
    ),
]

AllowUserMigrationOpt = Annotated[
    bool,
    typer.Option(
        "--allow-user-migration",
        help="Without --admin-api-key, let the API key (or, without any key, anyone) call the migration and hold "
        "routes, as SGLang does; off: they need the admin key, and a non-loopback --host needs one to start.",
    ),
]
RequestTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--request-timeout",
        min=0,
        help="Default deadline of a /generate request in seconds (aborted after it, answering what it generated; "
        "a request's own 'timeout' wins); 0: none.",
    ),
]
BodyTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--body-timeout", help="Seconds a request body may take to arrive; after it: 408 and the connection closed."
    ),
]
KeepAliveTimeoutOpt = Annotated[
    int,
    typer.Option(
        "--keep-alive-timeout",
        min=1,
        help="Seconds an idle keep-alive connection stays open (keep it above your clients' keep-alive expiry).",
    ),
]
MaxConnectionsOpt = Annotated[
    int,
    typer.Option("--max-connections", min=1, help="Most concurrent connections or requests; beyond: 503."),
]


def serve(
    ctx: typer.Context,
    port: PortOpt = 30000,
    host: HostOpt = LOOPBACK,
    enable_kv_migration: EnableKvMigrationOpt = False,
    kv_migration_watchdog_timeout: KvMigrationWatchdogTimeoutOpt = 60.0,
    watchdog_interval: WatchdogIntervalOpt = 1.0,
    model: ModelOpt = "qwen3-tiny",
    seed: SeedOpt = 1,
    num_pages: NumPagesOpt = 128,
    page_size: PageSizeOpt = 16,
    host_pages: HostPagesOpt = 0,
    max_running: MaxRunningOpt = 16,
    max_prefill_tokens: MaxPrefillTokensOpt = 2048,
    dtype: DtypeOpt = Dtype.float32,
    weight_version: WeightVersionOpt = "0",
    transport: TransportOpt = KVTransport.auto,
    max_body_bytes: MaxBodyBytesOpt = 8 << 20,
    peer_timeout: PeerTimeoutOpt = 60.0,
    tp_size: TpSizeOpt = 1,
    kvmove_routes: KvmoveRoutesOpt = True,
    handover_timeout: HandoverTimeoutOpt = 600.0,
    hold_timeout: HoldTimeoutOpt = 120.0,
    api_key: ApiKeyOpt = None,
    admin_api_key: AdminKeyOpt = None,
    allowed_peers: AllowedPeersOpt = "",
    migration_share: MigrationShareOpt = 0.5,
    peer_share: PeerShareOpt = 0.5,
    allow_user_migration: AllowUserMigrationOpt = False,
    request_timeout: RequestTimeoutOpt = 0.0,
    body_timeout: BodyTimeoutOpt = 30.0,
    keep_alive_timeout: KeepAliveTimeoutOpt = 20,
    max_connections: MaxConnectionsOpt = 2048,
) -> None:
    """Serve one rollout worker over HTTP (/generate, /tokenize, /health, /metrics and the migration routes).

    Prints one line with its URL on stdout once it accepts requests; logs go to stderr. /metrics is Prometheus
    text, /metrics.json the same as JSON. A port in use, KV pools larger than the memory available, or a --host no
    interface carries (with NIXL) are refused (exit 2) before the model is built. Keys may also come from the
    environment (KVMOVE_API_KEY, KVMOVE_ADMIN_API_KEY), which keeps them off the process list; see the README's
    threat model for who can reach what. With --enable-kv-migration the migration and hold routes need the admin
    key (--allow-user-migration: the API key too), and a non-loopback --host needs one to start. A /generate
    request whose client disconnects is aborted at once (its pages freed).

    Example: kvmove serve --port 30001 --enable-kv-migration --admin-api-key "$KEY" --allowed-peers 10.0.0.2:30001
    """
    _serve(server_config(ctx.params))


def server_config(options: Mapping[str, Any]) -> ServerConfig:
    """The server's frozen settings from ``serve``'s options (``ctx.params``): each option is the field of the same
    name; enums give their values and ``--allowed-peers`` its comma-separated addresses."""
    fields = {k: v.value if isinstance(v, Enum) else v for k, v in options.items()}
    fields["allowed_peers"] = tuple(p.strip() for p in options["allowed_peers"].split(",") if p.strip())
    return ServerConfig(**fields)


def _serve(config: ServerConfig) -> None:
    """Take the port, check what can be checked up front, then build and serve (a port in use, pools larger than
    the memory available, a --host no interface carries: refused before the model is built)."""
    from kvmove.server.listen import listen

    sock = listen(config.host, config.port)  # a port in use is refused before anything heavy is imported or built
    try:
        from kvmove.server.resources import check_server_memory

        check_server_memory(config)  # NOTE: refused before NIXL, the model or a pool is touched
        choice = warn_fallback(config.transport) if config.enable_kv_migration else None
        if choice is not None and choice.name == "nixl":
            from kvmove.transport.interfaces import interface_of

            interface_of(config.host)  # NOTE: NIXL will listen on the interface of --host: one of this host's
        if config.enable_kv_migration and config.api_key and not (config.admin_api_key or config.allow_user_migration):
            typer.echo(
                "kvmove: warning: no --admin-api-key: the migration routes refuse the API key, so this worker cannot "
                "migrate (set --admin-api-key, or --allow-user-migration to let API-key holders migrate)",
                err=True,
            )
        migration = f"KV migration over {choice.name}" if choice is not None else "no KV migration"
        from kvmove.server.launch import serve as run  # NOTE: fastapi/uvicorn are the optional `serve` extra

        def ready(url: str) -> None:
            print(f"kvmove serve: ready on {url} ({config.model}, {migration})", file=streams.out(), flush=True)

        run(config, ready=ready, sock=sock)
    finally:
        sock.close()


def warn_fallback(transport: str) -> TransportChoice:
    """What ``--transport`` resolves to; a warning line on stderr when ``auto`` falls back to http."""
    from kvmove.migration.endpoint import choose_transport

    choice = choose_transport(transport)
    if choice.fallback:
        typer.echo(f"kvmove: warning: {choice.note}", err=True)
    return choice
