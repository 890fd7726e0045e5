"""The HTTP layer: one line per route, each delegating to the runtime or the migration core.

Routes and bodies follow SGLang's server and its KV-migration fork (kvmove/migration/messages.py); errors are
``{"success": false, "message": ...}`` with a 4xx/5xx status (400 for malformed bodies instead of FastAPI's 422).
``/kvmove/read_pages`` is the ``http`` transport's data plane: raw bytes out, refusals as above.

With ``kvmove_routes`` off, the server answers only what an SGLang server of the fork answers: SGLang's own routes
and the fork's five migration routes; kvmove's control routes (``/abort_transfer_request_kvcache``,
``/kvmove/hold_request``, ``/kvmove/release_request``, ``/kvmove/integrity``) are absent (404). The peer-to-peer
data plane (``/kvmove/pull_kv``, ``/kvmove/read_pages``) stays: it is how two kvmove servers move the bytes, as the
fork's servers use their transfer engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from kvmove.engines.reference import UnknownRequestError
from kvmove.errors import KvmoveError
from kvmove.migration import messages as m
from kvmove.migration.errors import MigrationError
from kvmove.server.runtime import Runtime
from kvmove.transport.http_route import READ_PATH, answer_read


def create_app(rt: Runtime) -> FastAPI:
    app = FastAPI(title="kvmove rollout worker")
    _install_error_handlers(app, rt.config.max_body_bytes)
    _install_metrics(app, rt)

    @app.get("/health")
    def health() -> m.Health:
        return m.Health()

    @app.post("/generate")
    async def generate(body: m.GenerateReq) -> m.GenerateResp:
        return await rt.generate(body)

    @app.post("/tokenize")
    def tokenize(body: m.TokenizeReq) -> m.TokenizeResp:
        return _tokenize(rt, body)

    @app.post("/detokenize")
    def detokenize(body: m.DetokenizeReq) -> m.DetokenizeResp:
        return m.DetokenizeResp(text=rt.tokenizer.decode(body.tokens))

    @app.post("/flush_cache")
    def flush_cache() -> m.FlushCacheResp:
        return rt.flush_cache()

    @app.post("/abort_request")
    def abort_request(body: m.AbortRequestReq) -> Response:
        rt.abort_request(body)
        return Response(status_code=200)

    _add_migration_routes(app, rt)
    if rt.config.kvmove_routes:
        _add_kvmove_routes(app, rt)
    return app


def _add_migration_routes(app: FastAPI, rt: Runtime) -> None:
    """The SGLang fork's five migration routes and kvmove's server-to-server data plane."""

    @app.get("/get_transfer_session_ids")
    def get_transfer_session_ids() -> m.TransferSessionIds:
        return rt.session_ids()

    @app.post("/get_request_extra_token_size")
    def get_request_extra_token_size(body: m.GetRequestExtraTokenSizeReq) -> m.GetRequestExtraTokenSizeResp:
        return rt.target.extra_token_size(body)

    @app.post("/allocate_token_for_transfer_request")
    def allocate_token_for_transfer_request(body: m.AllocateTokenForTransferReq) -> m.AllocateTokenForTransferResp:
        return rt.target.allocate(body)

    @app.post("/transfer_request_kvcache")
    def transfer_request_kvcache(body: m.TransferRequestKVCacheReq) -> m.TransferRequestKVCacheResp:
        return rt.source.transfer(body)

    @app.post("/commit_transfer_request_kvcache")
    def commit_transfer_request_kvcache(body: m.CommitTransferReq) -> m.CommitTransferResp:
        return rt.target.commit(body)

    # -- kvmove's peer-to-peer data plane ---------------------------------------------------------------------

    @app.post("/kvmove/pull_kv")
    def pull_kv(body: m.PullKVReq) -> m.PullKVResp:
        return rt.target.pull(body)

    @app.post(READ_PATH, response_class=Response)
    async def read_pages(request: Request) -> Response:
        return await answer_read(request, rt.read_pages)


def _add_kvmove_routes(app: FastAPI, rt: Runtime) -> None:
    """kvmove's control routes: migration abort, request hand-over, integrity."""

    @app.post("/abort_transfer_request_kvcache")
    def abort_transfer_request_kvcache(body: m.AbortTransferReq) -> m.AbortTransferResp:
        return rt.target.abort(body.migration_id)

    @app.post("/kvmove/hold_request")
    def hold_request(body: m.HoldRequestReq) -> m.HoldRequestResp:
        return rt.hold(body)

    @app.post("/kvmove/release_request")
    def release_request(body: m.ReleaseRequestReq) -> m.ReleaseRequestResp:
        return rt.release(body)

    @app.get("/kvmove/integrity")
    def integrity() -> m.Integrity:
        return rt.integrity()


def _install_metrics(app: FastAPI, rt: Runtime) -> None:
    """``/metrics``: Prometheus text (``?format=json``: JSON); ``/metrics.json``: JSON, as scripts read it."""
    from kvmove.server.prometheus import CONTENT_TYPE, exposition, registry_for

    registry = registry_for(rt)

    @app.get("/metrics", response_model=None)
    def metrics(format: str = "prometheus") -> m.Metrics | Response:
        if format == "json":
            return rt.metrics()
        return Response(exposition(registry), media_type=CONTENT_TYPE)

    @app.get("/metrics.json")
    def metrics_json() -> m.Metrics:
        return rt.metrics()


def _tokenize(rt: Runtime, body: m.TokenizeReq) -> m.TokenizeResp:
    max_len = rt.worker.pool.num_pages * rt.config.page_size
    if isinstance(body.prompt, str):
        tokens = rt.tokenizer.encode(body.prompt)
        return m.TokenizeResp(tokens=tokens, count=len(tokens), max_model_len=max_len)
    batch = [rt.tokenizer.encode(p) for p in body.prompt]
    return m.TokenizeResp(tokens=batch, count=[len(t) for t in batch], max_model_len=max_len)


def _failure(status: int, message: str, **extra: object) -> JSONResponse:
    return JSONResponse(status_code=status, content={"success": False, "message": message, **extra})


def _install_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        text = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return _failure(400, text, object="error", type="Bad Request", param=None, code=400)

    @app.exception_handler(MigrationError)
    async def migration_error(_: Request, exc: MigrationError) -> JSONResponse:
        return _failure(exc.status, str(exc))

    @app.exception_handler(UnknownRequestError)
    async def unknown_request(_: Request, exc: UnknownRequestError) -> JSONResponse:
        return _failure(404, str(exc))

    @app.exception_handler(KvmoveError)
    async def refused(_: Request, exc: KvmoveError) -> JSONResponse:
        return _failure(400, str(exc))

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
            return _failure(413, f"request body of {size} bytes is over the {max_body_bytes}-byte limit")
        return await call_next(request)
