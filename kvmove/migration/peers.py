"""Peer addresses: a rank's ``session_id`` is ``host:port`` of its server, validated before any request goes out.

A session id arrives in request bodies (the target of a transfer, the source of a pull), so it is never pasted into
a URL: ``PeerAddress.parse`` accepts exactly an IPv4 literal, a bracketed IPv6 literal or a DNS name, a colon and a
decimal port in [1, 65535], and nothing else (no scheme, user, path, query, fragment, whitespace or escapes);
``url`` builds the request URL from those parts. ``PeerPolicy`` optionally restricts peers to an allow-list.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import httpx

from kvmove.migration.errors import MigrationError

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_PORT = re.compile(r"[0-9]{1,5}")


class PeerRefusedError(MigrationError):
    """A session id that is not a plain ``host:port``, or a peer outside the allow-list."""

    status = 403


class PeerAddress(NamedTuple):
    host: str
    port: int

    @classmethod
    def parse(cls, session_id: str) -> PeerAddress:
        """The address in ``session_id``; PeerRefusedError saying why it is not a plain ``host:port``."""
        shown = repr(session_id[:80])
        host, sep, port = session_id.rpartition(":")
        if not sep or not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
            raise PeerRefusedError(f"session_id {shown} is not host:port with a port in [1, 65535]")
        if not _valid_host(host):
            raise PeerRefusedError(
                f"session_id {shown}: host must be an IPv4 address, a [bracketed] IPv6 address or a DNS name"
            )
        return cls(host.lower(), int(port))

    @property
    def session_id(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return str(self.url(""))

    def url(self, path: str) -> httpx.URL:
        """``http://host:port/path``, assembled from the validated parts (never by pasting strings)."""
        return httpx.URL(scheme="http", host=self.host.strip("[]"), port=self.port, path=path)


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return isinstance(ipaddress.ip_address(host[1:-1]), ipaddress.IPv6Address) and "%" not in host
        except ValueError:
            return False
    if not host or len(host) > 253:
        return False
    return all(_LABEL.fullmatch(label) for label in host.split("."))


@dataclass(frozen=True)
class PeerPolicy:
    """Which peers this rank talks to: any valid address, or only those in ``allowed`` (when non-empty)."""

    allowed: frozenset[PeerAddress] = frozenset()

    @classmethod
    def of(cls, session_ids: Iterable[str]) -> PeerPolicy:
        return cls(frozenset(PeerAddress.parse(s) for s in session_ids))

    def check(self, session_id: str) -> PeerAddress:
        """The validated address of ``session_id``; PeerRefusedError if invalid or not allowed."""
        peer = PeerAddress.parse(session_id)
        if self.allowed and peer not in self.allowed:
            raise PeerRefusedError(f"peer {peer.session_id} is not in this server's --allowed-peers list")
        return peer
