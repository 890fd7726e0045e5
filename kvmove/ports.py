"""Listening ports handed to other processes before anyone binds them.

A port that one process picks and another binds later can be taken in between. Asking the kernel for port 0
hands out a port from the ephemeral range, the same range every outgoing connection draws its local port
from, so on a busy machine (Ray, HTTP clients, other tests) such a port is soon reused by a ``connect``.
Ports picked here lie below the ephemeral range, where only explicit listeners go, and are checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FALLBACK_EPHEMERAL_LOW = 32768
_LOWEST = 20000
_TRIES = 64


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now, outside the ephemeral range where possible."""
    high = ephemeral_low()
    if high - _LOWEST > 1000:
        for port in random.sample(range(_LOWEST, high), _TRIES):
            if _bindable(host, port):
                return port
    with socket.socket() as s:  # the whole low range is busy (or there is none): the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
