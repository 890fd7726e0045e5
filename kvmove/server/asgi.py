"""ASGI plumbing shared by the server's middlewares: type aliases and a JSON answer sent without FastAPI."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def failure(message: str, **extra: object) -> dict[str, Any]:
    """The body of every refusal: ``{"success": false, "message": ...}`` plus ``extra`` keys."""
    return {"success": False, "message": message, **extra}


async def send_json(send: Send, status: int, body: dict[str, Any], close: bool = False) -> None:
    """Answer ``body`` with ``status``; ``close`` asks the client to drop the connection (unread body left)."""
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


async def disconnected(receive: Receive) -> None:
    """Return once the client of a request whose body was read has disconnected (the server's ``http.disconnect``
    message; it also comes once the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass
