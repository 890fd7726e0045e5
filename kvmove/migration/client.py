"""HTTP client of one kvmove (or SGLang-fork) server: one method per route, every call bounded in time.

``api_key`` is sent as ``Authorization: Bearer`` with every call (the server's admin key drives migrations).
Failure answers raise the MigrationError subclass of their status (``error_for_status``), message kept.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from kvmove.migration import messages as m
from kvmove.migration.errors import PeerUnreachableError, error_for_status, failure_message
from kvmove.server.messages import (
    AbortRequestReq,
    FlushCacheResp,
    GenerateReq,
    GenerateResp,
    HoldRequestReq,
    HoldRequestResp,
    Integrity,
    Metrics,
    ReleaseRequestReq,
    ReleaseRequestResp,
    Resources,
)

T = TypeVar("T", bound=BaseModel)


class WorkerClient:
    def __init__(self, url: str, timeout: float = 60.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> Metrics:
        return self._call("GET", "/metrics.json", None, Metrics)

    def resources(self) -> Resources:
        return self._call("GET", "/kvmove/resources", None, Resources)

    def integrity(self) -> Integrity:
        return self._call("GET", "/kvmove/integrity", None, Integrity)

    def flush_cache(self) -> FlushCacheResp:
        return self._call("POST", "/flush_cache", None, FlushCacheResp)

    def generate(self, body: GenerateReq, timeout: float | None = None) -> GenerateResp:
        return self._call("POST", "/generate", body, GenerateResp, timeout)

    def session_ids(self) -> m.TransferSessionIds:
        return self._call("GET", "/get_transfer_session_ids", None, m.TransferSessionIds)

    def extra_token_size(self, body: m.GetRequestExtraTokenSizeReq) -> m.GetRequestExtraTokenSizeResp:
        return self._call("POST", "/get_request_extra_token_size", body, m.GetRequestExtraTokenSizeResp)

    def allocate(self, body: m.AllocateTokenForTransferReq) -> m.AllocateTokenForTransferResp:
        return self._call("POST", "/allocate_token_for_transfer_request", body, m.AllocateTokenForTransferResp)

    def transfer(self, body: m.TransferRequestKVCacheReq) -> m.TransferRequestKVCacheResp:
        return self._call("POST", "/transfer_request_kvcache", body, m.TransferRequestKVCacheResp)

    def commit(self, migration_id: str) -> m.CommitTransferResp:
        body = m.CommitTransferReq(migration_id=migration_id)
        return self._call("POST", "/commit_transfer_request_kvcache", body, m.CommitTransferResp)

    def abort(self, migration_id: str) -> m.AbortTransferResp:
        body = m.AbortTransferReq(migration_id=migration_id)
        return self._call("POST", "/abort_transfer_request_kvcache", body, m.AbortTransferResp)

    def abort_request(self, rid: str) -> None:
        """SGLang's ``/abort_request``: the request's own ``/generate`` call then answers with what it has."""
        try:
            resp = self._http.post("/abort_request", json=AbortRequestReq(rid=rid).model_dump())
        except httpx.HTTPError as exc:
            raise PeerUnreachableError(f"{self.url}/abort_request: {exc!r}") from exc
        if resp.status_code != 200:
            message = failure_message(resp.status_code, resp.reason_phrase, resp.content)
            raise error_for_status(resp.status_code, f"{self.url}/abort_request: {message}")

    def hold(self, rid: str) -> HoldRequestResp:
        return self._call("POST", "/kvmove/hold_request", HoldRequestReq(rid=rid), HoldRequestResp)

    def release(self, rid: str, migrated: bool, target: str = "") -> ReleaseRequestResp:
        body = ReleaseRequestReq(rid=rid, migrated=migrated, target=target)
        return self._call("POST", "/kvmove/release_request", body, ReleaseRequestResp)

    def _call(self, method: str, path: str, body: BaseModel | None, out: type[T], timeout: float | None = None) -> T:
        kwargs: dict[str, Any] = {} if body is None else {"json": body.model_dump()}
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise PeerUnreachableError(f"{self.url}{path}: {exc!r}") from exc
        if resp.status_code != 200:
            message = failure_message(resp.status_code, resp.reason_phrase, resp.content)
            raise error_for_status(resp.status_code, f"{self.url}{path}: {message}")
        return out.model_validate(resp.json())
