"""Clients that misbehave, as a soak drives them against a server: one that gives up on its ``/generate`` request
(the connection closed while the request runs), one that sends half a body and stalls.

The server must abort the abandoned request at once and close the stalled connection after its body timeout;
``MisbehavingClients.settle`` waits for both and says what the server failed to let go of.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field

import httpx

from kvmove.migration.client import WorkerClient

STALL_HEAD = b"POST /generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n"


@dataclass
class MisbehavingClients:
    """``give_up_after``: seconds an abandoning client waits for its answer; ``body_timeout``: the servers'."""

    give_up_after: float = 0.2
    body_timeout: float = 1.0
    abandoned: int = 0
    stalled: int = 0
    closed_by_server: int = 0
    _stalls: list[tuple[str, socket.socket]] = field(default_factory=list)

    def abandon(self, url: str, ids: list[int], new_tokens: int, key: str | None) -> None:
        """A greedy request of ``new_tokens`` whose client disconnects after ``give_up_after`` seconds."""
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            httpx.post(f"{url}/generate", json=body, headers=headers, timeout=self.give_up_after)
        except httpx.TimeoutException:
            self.abandoned += 1
            return
        raise RuntimeError(f"{url}: a {new_tokens}-token request answered within {self.give_up_after} s")

    def stall(self, url: str) -> None:
        """A connection that sent its headers and the start of a 4096-byte body, and then nothing."""
        host, _, port = url.removeprefix("http://").rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(STALL_HEAD + json.dumps({"input_ids": [1, 2, 3]}).encode()[:-2])
        self._stalls.append((url, sock))
        self.stalled += 1

    def settle(self, clients: list[WorkerClient]) -> list[str]:
        """Wait until every stalled connection was closed by its server (within the body timeout, plus slack) and
        every server runs and queues nothing (abandoned requests aborted); what did not happen, else []."""
        problems = []
        deadline = time.monotonic() + self.body_timeout + 10
        for url, sock in self._stalls:
            if _closed_by_peer(sock, deadline):
                self.closed_by_server += 1
            else:
                problems.append(f"{url} kept a stalled connection open past the {self.body_timeout:g} s body timeout")
            sock.close()
        self._stalls.clear()
        for c in clients:
            while (busy := _busy(c)) and time.monotonic() < deadline:
                time.sleep(0.02)
            if busy:
                problems.append(f"{c.url} still runs or queues {busy} requests nobody waits for")
        return problems


def _closed_by_peer(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closed ``sock`` (after answering, or not) before ``deadline``."""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True


def _busy(c: WorkerClient) -> int:
    metrics = c.metrics()
    return metrics.running + sum(metrics.waiting_per_priority.values())
