"""The ``http`` transport's read route: wire format of a read, the HTTP answer, and a loopback web server.

``POST /kvmove/read_pages`` (``READ_PATH``) takes a JSON ``ReadRequest`` (one registered buffer, ``(offset,
nbytes)`` spans of it, a grant) and answers the spans' raw bytes in order (``application/octet-stream``), or
``{"success": false, "message"}`` with a 4xx status (``ReadRefused``). ``answer_read`` is the route's handler on any
Starlette/FastAPI app (a kvmove server's own, or ``LoopbackServer``'s); the endpoint behind it is
``kvmove.transport.http.HttpTransport.serve``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvmove.transport.base import TransportError

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

READ_PATH = "/kvmove/read_pages"
OCTETS = "application/octet-stream"
CHUNK_BYTES = 1 << 20
"""Answers are copied and sent in chunks of at most this many bytes; one chunk is sent in one piece."""


class ReadRefused(TransportError):
    """A read request the serving endpoint refuses; ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ReadAnswer(NamedTuple):
    """What ``serve`` answers: ``nbytes`` in total, copied chunk by chunk as ``chunks`` is iterated."""

    nbytes: int
    chunks: Iterator[memoryview]


@dataclass(frozen=True)
class ReadRequest:
    """The body of one read: ``spans`` is an ``(n, 2)`` int64 array of ``(offset, nbytes)`` in ``buffer_id``."""

    endpoint: str
    buffer_id: int
    grant: str
    spans: np.ndarray

    def to_json(self) -> bytes:
        body = {"endpoint": self.endpoint, "buffer_id": self.buffer_id, "grant": self.grant}
        return json.dumps({**body, "spans": self.spans.tolist()}).encode()

    @classmethod
    def parse(cls, body: bytes) -> ReadRequest:
        """The request in ``body``, or ReadRefused(400) saying what is malformed."""
        try:
            raw = json.loads(body)
        except ValueError as exc:
            raise ReadRefused(400, f"read request is not valid JSON: {exc}") from exc
        fields = {"endpoint": str, "buffer_id": int, "grant": str, "spans": list}
        if not isinstance(raw, dict) or set(raw) != set(fields):
            raise ReadRefused(400, f"a read request is a JSON object with exactly the keys {sorted(fields)}")
        wrong = [k for k, t in fields.items() if type(raw[k]) is not t]
        if wrong:
            raise ReadRefused(400, f"read request fields of the wrong type: {', '.join(wrong)}")
        spans = raw["spans"]
        if not all(type(s) is list and len(s) == 2 and type(s[0]) is type(s[1]) is int for s in spans):
            raise ReadRefused(400, "spans must be a list of [offset, nbytes] integer pairs")
        try:
            array = np.array(spans, dtype=np.int64).reshape(-1, 2) if spans else np.zeros((0, 2), np.int64)
        except OverflowError as exc:
            raise ReadRefused(400, "span offsets and lengths must fit in 64 bits") from exc
        if (array < 0).any():
            raise ReadRefused(400, "span offsets and lengths must be non-negative")
        return cls(raw["endpoint"], raw["buffer_id"], raw["grant"], array[array[:, 1] > 0])

    def check_bounds(self, nbytes: int, endpoint: str) -> None:
        """ReadRefused(400) naming the first span that ends past the ``nbytes``-byte buffer."""
        offsets, lengths = self.spans[:, 0], self.spans[:, 1]
        # NOTE: the first two terms keep the sum from wrapping around in int64
        past = (offsets > nbytes) | (lengths > nbytes) | (offsets + lengths > nbytes)
        if past.any():
            offset, n = (int(x) for x in self.spans[int(np.argmax(past))])
            where = f"the {nbytes}-byte buffer {endpoint}#{self.buffer_id}"
            raise ReadRefused(400, f"span ({offset}, {n}) ends at byte {offset + n}, past {where}")


async def answer_read(request: Request, serve: Callable[[bytes], ReadAnswer]) -> Response:
    """The HTTP answer to one read request: 200 with the bytes (copied on worker threads, off the event loop; one
    piece up to ``CHUNK_BYTES``, streamed in chunks beyond), or ``{"success": false, "message"}`` with the
    refusal's status."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response, StreamingResponse

    body = await request.body()
    try:
        answer, whole = await run_in_threadpool(_serve_small_at_once, serve, body)
    except ReadRefused as exc:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=exc.status)
    if whole is not None:
        return Response(whole, media_type=OCTETS)
    # NOTE: streamed, since one large write through h11 and asyncio runs at a third of the speed of 1 MiB chunks
    headers = {"content-length": str(answer.nbytes)}
    return StreamingResponse(answer.chunks, media_type=OCTETS, headers=headers)


class Served(NamedTuple):
    """A read's answer, and its bytes already copied when they fit one chunk (None: streamed)."""

    answer: ReadAnswer
    whole: memoryview | None


def _serve_small_at_once(serve: Callable[[bytes], ReadAnswer], body: bytes) -> Served:
    """``serve(body)``, and its bytes already copied when they fit one chunk (no streaming for small reads)."""
    answer = serve(body)
    if answer.nbytes > CHUNK_BYTES:
        return Served(answer, None)
    return Served(answer, next(answer.chunks, memoryview(b"")))


class LoopbackServer:
    """A uvicorn server in a daemon thread of this process routing ``READ_PATH`` to ``serve``."""

    def __init__(self, serve: Callable[[bytes], ReadAnswer], host: str) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        async def read_pages(request: Request) -> Response:
            return await answer_read(request, serve)

        app = Starlette(routes=[Route(READ_PATH, read_pages, methods=["POST"])])
        # NOTE: asyncio turns TCP_NODELAY on only for sockets whose proto says TCP; without it every answer
        # waits ~40 ms for the ACK of its headers (Nagle + delayed ACK)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind((host, 0))
        netloc = f"[{host}]" if family == socket.AF_INET6 else host
        self.url = f"http://{netloc}:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="kvmove-http-transport", daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> LoopbackServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise TransportError(f"the http transport's server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
