"""Network interfaces of this host: which one carries an address, so a transport can listen on that one only.

A server bound to ``127.0.0.1`` must not have its data plane listen on the routable interface too; UCX (under
NIXL) listens on every interface unless ``UCX_NET_DEVICES`` names some, so the server passes the interface of its
own bind address (``interface_of``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

from kvmove.errors import KvmoveError

_SIOCGIFADDR = 0x8915
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def interface_of(host: str) -> str | None:
    """The name of the interface that carries ``host`` (an address or a name resolving to one of this host's),
    or None for a wildcard bind (every interface). KvmoveError if no interface here carries it."""
    if host in WILDCARDS:
        return None
    wanted = _addresses(host.strip("[]"))
    for name, address in _interface_addresses():
        if address in wanted or (address.is_loopback and all(w.is_loopback for w in wanted)):
            return name
    raise KvmoveError(f"no network interface of this host carries {host!r}: bind to one of its own addresses")


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise KvmoveError(f"cannot resolve {host!r}: {exc}") from exc
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}


def _interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """(interface, address) for every IPv4 address (one per interface) and every IPv6 one of this host."""
    found: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found.append((name, ipaddress.IPv4Address(raw[20:24])))
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            found.append((fields[5], ipaddress.IPv6Address(int(fields[0], 16))))
    return found
