"""Migration errors; each carries the HTTP status the server answers with (always ``{"success": false, ...}``)."""

from __future__ import annotations

import json

from kvmove.errors import KvmoveError


class MigrationError(KvmoveError):
    """A migration call refused; nothing was changed on this side."""

    status = 400


class MigrationDisabledError(MigrationError):
    status = 403


class UnknownMigrationError(MigrationError):
    status = 404


class PeerMismatchError(MigrationError):
    """Page size, layer count, dtype, KV heads or weight version differ between the peers."""

    status = 409


class MigrationConflictError(MigrationError):
    """The cache changed since the caller looked (matched + extra != total), or a migration was already filled."""

    status = 409


class OutOfPagesError(MigrationError):
    status = 503


class ShareExceededError(MigrationError):
    """One migration, or the pending migrations of one peer, would hold more of a pool than their share."""

    status = 429


class ChecksumMismatchError(MigrationError):
    """Pages pulled or about to be cached differ from what the source staged: nothing of them is cached."""

    status = 409


class PeerUnreachableError(MigrationError):
    """The peer server did not answer or failed (dead source/target, transport failure)."""

    status = 502


_BY_STATUS: dict[int, type[MigrationError]] = {
    400: MigrationError,
    403: MigrationDisabledError,
    404: UnknownMigrationError,
    409: MigrationConflictError,
    429: ShareExceededError,
    503: OutOfPagesError,
}


def failure_message(status: int, reason: str, body: bytes) -> str:
    """What a peer's failure answer says: its ``message`` (a kvmove or SGLang failure body), else its text, and
    always its status (an empty 503 reads "HTTP 503 Service Unavailable, empty body")."""
    text = body.decode(errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("message") or parsed.get("detail"), str):
        text = parsed.get("message") or parsed["detail"]
    head = f"HTTP {status} {reason}".rstrip()
    return f"{head}: {' '.join(text.split())[:500]}" if text else f"{head}, empty body"


def error_for_status(status: int, message: str) -> MigrationError:
    """The error a client raises for a peer's failure answer (status and ``message`` kept)."""
    err = _BY_STATUS.get(status, PeerUnreachableError)(message)
    err.status = status
    return err
