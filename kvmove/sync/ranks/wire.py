"""The control plane's wire: typed commands (``control``) over authenticated TCP connections, by address.

A :class:`ControlServer` listens on one port per rank process and answers each connection in its own thread,
in order; :class:`ControlClient` is one connection. Connections authenticate with the run's secret key
(``multiprocessing.connection``'s HMAC challenge, run per connection so a silent peer blocks nobody) before any
message is unpickled, so only processes of the same run can talk to a rank. Nothing here needs Ray.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

from kvmove.errors import KvmoveError
from kvmove.sync.ranks.control import Address, Command, Failure


class RankUnreachable(KvmoveError):
    """A rank's control connection closed, was refused, or stayed silent past its deadline."""


class RemoteError(KvmoveError):
    """A command failed inside the rank that answered it (the message names the error there)."""


class ControlServer:
    """Answers commands with ``handle(command) -> reply`` on ``host`` (port chosen by the OS)."""

    def __init__(self, handle: Callable[[Any], Any], host: str, authkey: bytes) -> None:
        self._handle, self._authkey = handle, authkey
        self._socket = socket.create_server((host, 0), backlog=256)
        self.address = Address(host, int(self._socket.getsockname()[1]))
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvmove-control", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._socket.accept()
            except OSError:
                return
            conn = Connection(sock.detach())
            threading.Thread(target=self._serve, args=(conn,), name="kvmove-control-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            while True:
                command = conn.recv()
                reply = answer(self._handle, command)
                if not isinstance(command, Command) or command.wants_reply:
                    conn.send(reply)
        except (EOFError, OSError, ValueError, AuthenticationError):  # peer gone, or not of this run
            pass
        finally:
            conn.close()

    def close(self) -> None:
        """Stop accepting; connections already open end when their peers close them."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            self._socket.close()


def answer(handle: Callable[[Any], Any], command: Any) -> Any:
    """``handle(command)``, or a :class:`Failure` naming what it raised."""
    try:
        return handle(command)
    except Exception as exc:
        return Failure(type(exc).__name__, str(exc).strip() or type(exc).__name__, isinstance(exc, KvmoveError))


def unwrap(reply: Any, who: str) -> Any:
    """The reply, or the remote failure raised here as one line."""
    if isinstance(reply, Failure):
        if reply.user:
            raise KvmoveError(reply.message)
        raise RemoteError(f"{who}: {reply.kind}: {reply.message.splitlines()[0][:500]}")
    return reply


class ControlClient:
    """One authenticated connection to a rank's control server; replies come back in request order."""

    def __init__(self, address: Address, authkey: bytes, who: str, timeout_s: float = 60.0) -> None:
        self.who, self.timeout_s = who, timeout_s
        try:
            self._conn = Client((address.host, address.port), family="AF_INET", authkey=authkey)
        except (OSError, EOFError) as exc:
            raise RankUnreachable(f"{who} at {address.host}:{address.port} is unreachable: {exc}") from None
        except AuthenticationError:
            raise RankUnreachable(f"{who} at {address.host}:{address.port} refused this process's key") from None

    def send(self, command: Command) -> None:
        try:
            self._conn.send(command)
        except (OSError, ValueError) as exc:
            raise RankUnreachable(f"{self.who} closed its control connection ({exc})") from None

    def receive(self, timeout_s: float | None = None) -> Any:
        """The next reply (in request order), raised if it is a failure."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            if not self._conn.poll(wait):
                raise RankUnreachable(f"{self.who} did not answer within {wait:.0f} s")
            reply = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RankUnreachable(f"{self.who} closed its control connection ({type(exc).__name__})") from None
        return unwrap(reply, self.who)

    def call(self, command: Command, timeout_s: float | None = None) -> Any:
        self.send(command)
        return self.receive(timeout_s)

    def fileno(self) -> int:
        return self._conn.fileno()

    @property
    def connection(self) -> Connection:
        return self._conn

    def close(self) -> None:
        self._conn.close()


def node_address(loopback: bool) -> str:
    """The address other processes of the run reach this machine at (127.0.0.1 for a run on this machine)."""
    if loopback:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
