"""``http``: a peer's registered host buffers read over plain HTTP, the KV data plane when NIXL is absent.

The serving endpoint answers ``POST /kvmove/read_pages`` (``READ_PATH``): a JSON ``ReadRequest`` naming one
registered buffer, ``(offset, nbytes)`` spans of it and a grant, answered with the spans' raw bytes in order
(``application/octet-stream``). The reader streams the answer into its own registered buffer at the local
offsets it computed itself: they never leave the reader, so a peer can only choose what it serves, never where
it lands. Spans are bounds-checked against the named buffer; only buffers registered with the endpoint are read.

Every read names a grant. ``endpoint_info()`` carries one for every registered buffer, whole, for the endpoint's
life (the generic ``Transport`` contract, as NIXL agent metadata does); ``grant(spans)`` mints one for just those
spans until ``revoke``: a migration source grants the pages it staged for one transfer, to the one target it
asks to pull them, and revokes the grant when the transfer returns.

Where the route lives (``http_route``): a kvmove server passes its base ``url`` and mounts the route on its own
FastAPI app (``answer_read``); without a url the endpoint serves it from a ``LoopbackServer`` of its own, started
by the first ``endpoint_info()`` (benchmarks, tests).
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvmove.transport.base import (
    BufferDesc,
    EndpointInfo,
    Transport,
    TransportError,
    merged_intervals,
)
from kvmove.transport.http_route import CHUNK_BYTES, READ_PATH, LoopbackServer, ReadAnswer, ReadRefused, ReadRequest
from kvmove.transport.optional import can_import, import_optional

LOOPBACK = "127.0.0.1"
_ALL = object()  # grant scope: every registered buffer, whole
_UNKNOWN = object()


class HttpTransport(Transport):
    """An endpoint read over HTTP: ``serve`` answers peers (thread-safe), ``read`` pulls from them with httpx.

    ``url``: the base URL of the web server that routes ``READ_PATH`` to ``serve`` (None: start a loopback one).
    """

    name = "http"
    extra = "serve"

    def __init__(
        self,
        *,
        url: str | None = None,
        host: str = LOOPBACK,
        timeout_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``headers``: sent with every read this endpoint makes (a server's peer key)."""
        self._httpx = import_optional("httpx", "serve", "the http transport")
        super().__init__()
        self._url = url.rstrip("/") if url else None
        self._host, self._timeout_s = host, timeout_s
        self._headers = dict(headers or {})
        self._server: LoopbackServer | None = None
        self._start_lock = threading.Lock()
        self._grants: dict[str, Any] = {}
        self._grant_lock = threading.Lock()
        self._endpoint_grant: str | None = None
        self._links: dict[str, tuple[str, str]] = {}
        self._clients: dict[str, Any] = {}

    @classmethod
    def is_available(cls) -> bool:
        return all(can_import(m) for m in ("httpx", "starlette", "uvicorn"))

    @property
    def open_grants(self) -> int:
        """Grants minted by ``grant`` and not yet revoked."""
        with self._grant_lock:
            return len(self._grants) - (self._endpoint_grant in self._grants)

    def _register(self, buf: torch.Tensor, buffer_id: int) -> None:
        if buf.device.type != "cpu":
            raise TransportError(f"the http transport serves host memory only, not {buf.device}")

    # -- serving side ------------------------------------------------------------------------------------------

    def endpoint_info(self) -> EndpointInfo:
        """A grant of every registered buffer, whole, for the endpoint's life (starts the loopback server)."""
        self._check_open()
        with self._grant_lock:
            if self._endpoint_grant is None:
                self._endpoint_grant = secrets.token_urlsafe(16)
                self._grants[self._endpoint_grant] = _ALL
            grant = self._endpoint_grant
        return self._info(grant)

    def grant(self, spans: Mapping[int, Sequence[tuple[int, int]]]) -> EndpointInfo:
        """Endpoint info whose holder may read only ``spans`` (buffer id -> ``(offset, nbytes)``) until ``revoke``."""
        self._check_open()
        scope = {}
        for buffer_id, ranges in spans.items():
            buf = self._buffers.get(buffer_id)
            if buf is None:
                raise TransportError(f"buffer {buffer_id} is not registered with endpoint {self.endpoint}")
            scope[buffer_id] = merged_intervals(np.asarray(ranges, dtype=np.int64).reshape(-1, 2), buf.numel())
        token = secrets.token_urlsafe(16)
        with self._grant_lock:
            self._grants[token] = scope
        return self._info(token)

    @staticmethod
    def url_of(info: EndpointInfo) -> str:
        """The base URL a reader of ``info`` would send its reads to (TransportError if not an http info)."""
        return _parse_payload(info)[0]

    def revoke(self, info: EndpointInfo) -> None:
        """End the grant ``info`` carries; reads naming it are refused from now on. Idempotent."""
        _, token = _parse_payload(info)
        with self._grant_lock:
            self._grants.pop(token, None)
            if token == self._endpoint_grant:
                self._endpoint_grant = None

    def serve(self, body: bytes) -> ReadAnswer:
        """Check one peer's read (ReadRefused with the HTTP status if it may not read) and answer its bytes.

        Runs on the web server's threads, concurrently with this endpoint's own reads; takes no lock but the
        grants'. The answer copies chunk after chunk under that lock, each only while the grant still stands,
        so no byte leaves after ``revoke`` returned (the owner may reuse the memory from then on).
        """
        if self._closed:
            raise ReadRefused(404, f"endpoint {self.endpoint} is closed")
        req = ReadRequest.parse(body)
        if req.endpoint != self.endpoint:
            raise ReadRefused(404, f"endpoint {req.endpoint!r} is not served here (this is {self.endpoint})")
        buf = self._buffers.get(req.buffer_id)
        if buf is None:
            raise ReadRefused(404, f"buffer {req.buffer_id} is not registered with endpoint {self.endpoint}")
        req.check_bounds(buf.numel(), self.endpoint)
        self._authorize(req)
        return ReadAnswer(int(req.spans[:, 1].sum()), self._copies(req.grant, buf.numpy(), req.spans))

    def _copies(self, grant: str, src: np.ndarray, spans: np.ndarray) -> Iterator[memoryview]:
        for pieces in _chunks(spans, CHUNK_BYTES):
            out = bytearray(sum(n for _, n in pieces))
            view, pos = np.frombuffer(out, dtype=np.uint8), 0
            with self._grant_lock:
                if grant not in self._grants:
                    raise TransportError("the read grant was revoked during the read")
                for offset, n in pieces:
                    view[pos : pos + n] = src[offset : offset + n]
                    pos += n
            yield memoryview(out)

    def _authorize(self, req: ReadRequest) -> None:
        with self._grant_lock:
            scope = self._grants.get(req.grant, _UNKNOWN)
        if scope is _UNKNOWN:
            raise ReadRefused(403, "the read grant is unknown or was revoked (a transfer's grant ends with it)")
        if scope is _ALL:
            return
        allowed = scope.get(req.buffer_id)
        if allowed is None or not _inside(req.spans, allowed):
            raise ReadRefused(403, f"spans of buffer {req.buffer_id} outside what the read grant allows")

    def _info(self, grant: str) -> EndpointInfo:
        payload = json.dumps({"url": self._base_url(), "grant": grant}).encode()
        return EndpointInfo(self.name, self.endpoint, payload)

    def _base_url(self) -> str:
        with self._start_lock:
            if self._url is None:
                self._server = LoopbackServer(self.serve, self._host).start()
                self._url = self._server.url
            return self._url

    # -- reading side ------------------------------------------------------------------------------------------

    def _connect(self, peer: EndpointInfo) -> None:
        url, grant = _parse_payload(peer)
        self._links[peer.endpoint] = (url, grant)
        if url not in self._clients:
            # NOTE: without TCP_NODELAY a request's body waits for the ACK of its headers (Nagle): +40 ms a read
            nodelay = self._httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
            self._clients[url] = self._httpx.Client(
                base_url=url, timeout=self._timeout_s, transport=nodelay, headers=self._headers
            )

    def _read(self, peer: EndpointInfo, remote: BufferDesc, local: torch.Tensor, spans: np.ndarray) -> None:
        url, grant = self._links[peer.endpoint]
        body = ReadRequest(remote.endpoint, remote.buffer_id, grant, spans[:, [0, 2]]).to_json()
        sink = _Scatter(local.numpy(), spans[:, [1, 2]])
        try:
            with self._clients[url].stream(
                "POST", READ_PATH, content=body, headers={"content-type": "application/json"}
            ) as resp:
                if resp.status_code != 200:
                    raise TransportError(f"{url}{READ_PATH} refused the read ({resp.status_code}): {_message(resp)}")
                for chunk in resp.iter_raw():
                    sink.write(chunk)
        except self._httpx.HTTPError as exc:
            raise TransportError(f"read from {url}{READ_PATH} failed: {exc!r}") from exc
        sink.finish()

    def _close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._links.clear()
        with self._grant_lock:
            self._grants.clear()
        if self._server is not None:
            self._server.stop()


class _Scatter:
    """Lays a byte stream into ``local`` at its ``(local_offset, nbytes)`` spans, in order; never past them."""

    def __init__(self, local: np.ndarray, spans: np.ndarray) -> None:
        self.local, self.spans = local, spans.tolist()
        self.span, self.filled = 0, 0  # the span being filled, and how many of its bytes arrived

    def write(self, chunk: bytes) -> None:
        data = np.frombuffer(chunk, dtype=np.uint8)
        while len(data):
            if self.span == len(self.spans):
                raise TransportError("the peer answered more bytes than the spans asked for")
            lo, n = self.spans[self.span]
            take = min(n - self.filled, len(data))
            self.local[lo + self.filled : lo + self.filled + take] = data[:take]
            data, self.filled = data[take:], self.filled + take
            if self.filled == n:
                self.span, self.filled = self.span + 1, 0

    def finish(self) -> None:
        if self.span != len(self.spans):
            raise TransportError(f"the peer's answer ended after {self.span} of {len(self.spans)} spans")


class Payload(NamedTuple):
    """What an http endpoint's info carries: the base URL of its read route and the grant a reader presents."""

    url: str
    grant: str


def _parse_payload(info: EndpointInfo) -> Payload:
    """``(base_url, grant)`` of an http endpoint's info; TransportError if it is not one."""
    try:
        raw = json.loads(bytes(info.payload))
        url, grant = raw["url"], raw["grant"]
    except (TypeError, ValueError, KeyError) as exc:
        raise TransportError(f"endpoint info of {info.endpoint} is not an http transport's: {exc!r}") from exc
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not isinstance(grant, str):
        raise TransportError(f"endpoint info of {info.endpoint} has no http(s) url and grant")
    return Payload(url, grant)


def _inside(spans: np.ndarray, allowed: np.ndarray) -> bool:
    """Whether every ``(offset, nbytes)`` span lies within one of the ``[start, end)`` intervals."""
    if not len(spans):
        return True
    if not len(allowed):
        return False
    at = np.searchsorted(allowed[:, 0], spans[:, 0], side="right") - 1
    ends = allowed[np.maximum(at, 0), 1]
    return bool(((at >= 0) & (spans[:, 0] + spans[:, 1] <= ends)).all())


def _chunks(spans: np.ndarray, limit: int) -> Iterator[list[tuple[int, int]]]:
    """``(offset, nbytes)`` pieces of ``spans``, in order, grouped into lists of at most ``limit`` bytes."""
    group: list[tuple[int, int]] = []
    size = 0
    for offset, n in spans.tolist():
        while n:
            take = min(n, limit - size)
            group.append((offset, take))
            offset, n, size = offset + take, n - take, size + take
            if size == limit:
                yield group
                group, size = [], 0
    if group:
        yield group


def _message(resp: Any) -> str:
    text = resp.read().decode(errors="replace")
    if not text.strip():
        return f"{resp.reason_phrase or 'no reason'}, empty body"
    try:
        return str(json.loads(text).get("message", text))
    except (ValueError, AttributeError):
        return text[:500]
