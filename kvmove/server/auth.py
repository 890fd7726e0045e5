"""Who may call which route: SGLang's ``--api-key`` / ``--admin-api-key`` semantics, as an ASGI middleware.

Every route has an ``Access`` level (``route_access`` marks the endpoint; unmarked routes are ``NORMAL``):

- ``OPEN``: ``/health`` and ``/metrics`` never need a key (probes and Prometheus scraping, as in SGLang); what
  ``/metrics`` shows an unauthorized caller is reduced instead (no request ids, see ``is_admin``).
- ``NORMAL`` (generation, tokenizer): the API key when one is set, else open; the admin key is accepted too (a
  peer continuing a migrated request presents the admin key; SGLang would refuse it where both keys are set).
- ``ADMIN`` (SGLang's ``ADMIN_OPTIONAL``: cache flush, aborts, integrity, resources): the admin key when one is
  set; else the API key when that is set; else open.
- ``MIGRATION`` (the migration routes, the request hold and release, the KV data plane: what hands one client's
  request, prompt and outputs to another caller): the admin key when one is set; else, with only an API key, no
  caller at all (403 for the API key) unless the server allows user migration (``--allow-user-migration``, the
  SGLang fork's behaviour), when the API key opens them; with no key at all, open (the server then binds loopback
  unless it allows user migration: ``ServerConfig.check_exposure``).

Keys travel as ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``), compared in constant time. The decision
is made from the headers alone, before any byte of the body is read. A refusal is 401 (a key is needed and the
caller did not present it) with ``{"success": false, "message": ..., "error": "Unauthorized"}``, or 403 (the API key
on a migration route it does not open) with ``"error": "Forbidden"``.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvmove.server.asgi import ASGIApp, Receive, Scope, Send, failure, send_json

F = TypeVar("F", bound=Callable[..., Any])

ADMIN_STATE = "kvmove_admin"
"""Key of ``request.state`` (``scope["state"]``) telling a route whether its caller passed the ADMIN check."""


class Access(enum.Enum):
    OPEN = "open"
    NORMAL = "normal"
    ADMIN = "admin"
    MIGRATION = "migration"


def route_access(level: Access) -> Callable[[F], F]:
    """Mark a route's endpoint with its access level (read by ``AuthMiddleware`` when it matches the route)."""

    def mark(endpoint: F) -> F:
        endpoint._kvmove_access = level  # type: ignore[attr-defined]
        return endpoint

    return mark


@dataclass(frozen=True)
class ApiKeys:
    """The server's keys (None: not set). With neither set every route is open, as in SGLang. ``user_migration``:
    with no admin key, the API key opens the migration routes too (else nobody does)."""

    api_key: str | None = None
    admin_api_key: str | None = None
    user_migration: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    @property
    def peer_key(self) -> str | None:
        """The key this server presents to its peers' ADMIN routes (peers of one cluster share their keys)."""
        return self.admin_api_key or self.api_key

    def accepted(self, level: Access) -> tuple[str, ...] | None:
        """The keys that open a route of ``level`` (None: open to anyone)."""
        if level is Access.OPEN:
            return None
        if level is Access.MIGRATION and self.api_key and not self.admin_api_key:
            return (self.api_key,) if self.user_migration else ()
        if level in (Access.ADMIN, Access.MIGRATION):
            need = self.admin_api_key or self.api_key
            return (need,) if need else None
        if not self.api_key:
            return None
        return (self.api_key, self.admin_api_key) if self.admin_api_key else (self.api_key,)

    def allows(self, level: Access, presented: str | None) -> bool:
        keys = self.accepted(level)
        if keys is None:
            return True
        given = (presented or "").encode()
        return presented is not None and any(secrets.compare_digest(given, k.encode()) for k in keys)


def presented_key(headers: dict[str, str]) -> str | None:
    """The key in ``Authorization: Bearer <key>`` or ``x-api-key``, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return headers.get("x-api-key") or None


def bearer(key: str | None) -> dict[str, str]:
    """Request headers presenting ``key`` (none for None)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class AuthMiddleware:
    """Refuses a request whose route needs a key the caller did not present; tells admitted routes whether the
    caller would pass the ADMIN check (``scope["state"][ADMIN_STATE]``)."""

    def __init__(
        self, app: ASGIApp, keys: ApiKeys, routes: Callable[[], list[Any]], rids_level: Access = Access.ADMIN
    ) -> None:
        """``rids_level``: what a caller must pass to see request ids (``MIGRATION`` on a migration server: ids are
        what a hold names)."""
        self.app, self.keys, self.routes, self.rids_level = app, keys, routes, rids_level

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = presented_key(headers)
        scope.setdefault("state", {})[ADMIN_STATE] = self.keys.allows(self.rids_level, key)
        level = self._level(scope)
        if scope.get("method") == "OPTIONS" or self.keys.allows(level, key):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if level is Access.MIGRATION and not self.keys.admin_api_key and self.keys.allows(Access.NORMAL, key):
            message = (
                f"forbidden: {path} is a migration route, which the API key does not open: start the server with "
                "--admin-api-key (or --allow-user-migration to let API-key holders migrate requests)"
            )
            await send_json(send, 403, failure(message, error="Forbidden"))
            return
        admin = level in (Access.ADMIN, Access.MIGRATION) and bool(self.keys.admin_api_key)
        admin = admin or (level is Access.MIGRATION and not self.keys.user_migration)
        which = "admin API key" if admin else "API key"
        message = f"unauthorized: {path} needs the server's {which} (Authorization: Bearer <key>)"
        await send_json(send, 401, failure(message, error="Unauthorized"))

    def _level(self, scope: Scope) -> Access:
        from starlette.routing import Match

        for route in self.routes():
            match, child = route.matches(scope)
            if match is Match.FULL:
                endpoint = child.get("endpoint") or getattr(route, "endpoint", None)
                level = getattr(endpoint, "_kvmove_access", Access.NORMAL)
                return level if isinstance(level, Access) else Access.NORMAL
        return Access.NORMAL
