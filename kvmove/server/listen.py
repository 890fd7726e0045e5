"""Taking a server's port: done first, before any model is built, so a port in use costs nothing."""

from __future__ import annotations

import socket

from kvmove.errors import KvmoveError


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (SO_REUSEADDR, as uvicorn binds), or a KvmoveError naming the taken port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise KvmoveError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server there?)") from None
    return sock
