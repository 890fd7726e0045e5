"""Request body limit on the bytes actually read, whatever the framing (``Content-Length`` or chunked).

``BodyLimitMiddleware`` reads the whole body before the route runs, counting bytes as they arrive: a declared
``Content-Length`` over the limit is refused at once, and a body that grows past the limit (chunked, or longer
than it said) is refused as soon as it does, so at most ``max_bytes`` of it are ever held. The route then receives
the buffered body as one message, exactly as the client sent it.
"""

from __future__ import annotations

from kvmove.server.asgi import ASGIApp, Message, Receive, Scope, Send, failure, send_json


class BodyRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _too_large(limit: int, seen: int) -> BodyRefused:
    return BodyRefused(413, f"request body of {seen}+ bytes is over the {limit}-byte limit")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

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
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            piece = message.get("body", b"")
            seen += len(piece)
            if seen > self.max_bytes:
                raise _too_large(self.max_bytes, seen)
            chunks.append(piece)
            if not message.get("more_body", False):
                return b"".join(chunks)


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
