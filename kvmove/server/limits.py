"""Request body limits: on the bytes actually read, whatever the framing (``Content-Length`` or chunked), and on the
time the body takes to arrive.

``BodyLimitMiddleware`` reads the whole body before the route runs, counting bytes as they arrive: a declared
``Content-Length`` over the limit is refused at once, and a body that grows past the limit (chunked, or longer
than it said) is refused as soon as it does, so at most ``max_bytes`` of it are ever held. The route then receives
the buffered body as one message, exactly as the client sent it. A body that has not arrived whole within
``timeout_s`` of its headers (a client that stalled halfway, or trickles it) is answered 408 and its connection
closed, so a stalled upload holds neither a connection nor its buffered bytes for longer than that.

(uvicorn 0.54 has no body timeout of its own: its ``timeout_keep_alive`` covers only the idle time between
requests, and ``limit_concurrency`` bounds connections; both are set from the server's config in ``launch``.)
"""

from __future__ import annotations

import asyncio
import time

from kvmove.server.asgi import ASGIApp, Message, Receive, Scope, Send, failure, send_json


class BodyRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _too_large(limit: int, seen: int) -> BodyRefused:
    return BodyRefused(413, f"request body of {seen}+ bytes is over the {limit}-byte limit")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
        except BodyRefused as exc:
            await send_json(send, exc.status, failure(str(exc)), close=True)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and not declared.isdigit():
            raise BodyRefused(400, f"Content-Length {declared[:32]!r} is not a byte count")
        if declared is not None and int(declared) > self.max_bytes:
            raise _too_large(self.max_bytes, int(declared))
        chunks: list[bytes] = []
        seen = 0
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            message = await self._next(receive, deadline, seen)
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            piece = message.get("body", b"")
            seen += len(piece)
            if seen > self.max_bytes:
                raise _too_large(self.max_bytes, seen)
            chunks.append(piece)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _next(self, receive: Receive, deadline: float | None, seen: int) -> Message:
        if deadline is None:
            return await receive()
        try:
            return await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise BodyRefused(408, f"request body not whole within {self.timeout_s:g} s ({seen} bytes came)") from None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (disconnect notices)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
