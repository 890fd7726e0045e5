"""The HTTP layer: one line per route, each delegating to the runtime or the migration core.

Routes and bodies follow SGLang's server (kvmove/server/messages.py) and its KV-migration fork
(kvmove/migration/messages.py); errors are ``{"success": false, "message": ...}`` with a 4xx/5xx status (400 for
malformed bodies instead of FastAPI's 422), whatever failed: a body that does not parse, an unknown route, a
refusal, a bug. ``/generate`` aborts its request when its client disconnects
(``kvmove.server.runtime.Runtime.generate``).
``/kvmove/read_pages`` is the ``http`` transport's data plane: raw bytes out, refusals as above.

With ``kvmove_routes`` off, the server answers only what an SGLang server of the fork answers: SGLang's own routes
and the fork's five migration routes; kvmove's control routes (``/abort_transfer_request_kvcache``,
``/kvmove/hold_request``, ``/kvmove/release_request``, ``/kvmove/integrity``) are absent (404). The peer-to-peer
data plane (``/kvmove/pull_kv``, ``/kvmove/read_pages``) stays: it is how two kvmove servers move the bytes, as the
fork's servers use their transfer engine.

Every route carries its access level (``kvmove.server.auth``: open, normal, admin, migration; SGLang's
``--api-key`` and ``--admin-api-key``, the migration routes closed to the API key unless
``--allow-user-migration``). Without ``--enable-kv-migration`` the fork's five routes answer 403 (as the fork does)
and kvmove's migration routes (the data plane, abort, hand-over) are not served at all. Bodies are limited on the
bytes actually read, and on the time they take to arrive (``kvmove.server.limits``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmove.errors import KvmoveError
from kvmove.migration import messages as m
from kvmove.migration.errors import MigrationError
from kvmove.reference import RequestFailedError, UnknownRequestError
from kvmove.server.asgi import disconnected
from kvmove.server.auth import ADMIN_STATE, Access, AuthMiddleware, route_access
from kvmove.server.limits import BodyLimitMiddleware
from kvmove.server.messages import (
    AbortRequestReq,
    DetokenizeReq,
    DetokenizeResp,
    FlushCacheResp,
    GenerateReq,
    GenerateResp,
    Health,
    HoldRequestReq,
    HoldRequestResp,
    Integrity,
    Metrics,
    ReleaseRequestReq,
    ReleaseRequestResp,
    Resources,
    TokenizeReq,
    TokenizeResp,
)
from kvmove.server.runtime import Runtime
from kvmove.server.streaming import stream_answer
from kvmove.transport.http_route import READ_PATH, answer_read

OPEN, ADMIN, MIGRATION = route_access(Access.OPEN), route_access(Access.ADMIN), route_access(Access.MIGRATION)


def create_app(rt: Runtime) -> FastAPI:
    app = FastAPI(title="kvmove rollout worker")
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=rt.config.max_body_bytes, timeout_s=rt.config.body_timeout)
    rids = Access.MIGRATION if rt.config.enable_kv_migration else Access.ADMIN
    app.add_middleware(AuthMiddleware, keys=rt.config.keys, routes=lambda: app.router.routes, rids_level=rids)
    _install_metrics(app, rt)

    @app.get("/health")
    @OPEN
    def health() -> Health:
        return Health()

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateReq, request: Request) -> GenerateResp | StreamingResponse:
        gone = lambda: disconnected(request.receive)  # noqa: E731
        if body.stream:
            return StreamingResponse(stream_answer(rt, body, gone), media_type="text/event-stream")
        return await rt.generate(body, gone=gone)

    @app.post("/tokenize")
    def tokenize(body: TokenizeReq) -> TokenizeResp:
        return _tokenize(rt, body)

    @app.post("/detokenize")
    def detokenize(body: DetokenizeReq) -> DetokenizeResp:
        return DetokenizeResp(text=rt.tokenizer.decode(body.tokens))

    @app.post("/flush_cache")
    @ADMIN
    def flush_cache() -> FlushCacheResp:
        return rt.flush_cache()

    @app.post("/abort_request")
    @ADMIN
    def abort_request(body: AbortRequestReq) -> Response:
        rt.abort_request(body)
        return Response(status_code=200)

    _add_migration_routes(app, rt)
    if rt.config.enable_kv_migration:
        _add_data_plane(app, rt)
    if rt.config.kvmove_routes:
        _add_kvmove_routes(app, rt)
    return app


def _add_migration_routes(app: FastAPI, rt: Runtime) -> None:
    """The SGLang fork's five migration routes (403 "not enabled" without --enable-kv-migration, as the fork)."""

    @app.get("/get_transfer_session_ids")
    @MIGRATION
    def get_transfer_session_ids() -> m.TransferSessionIds:
        return rt.session_ids()

    @app.post("/get_request_extra_token_size")
    @MIGRATION
    def get_request_extra_token_size(body: m.GetRequestExtraTokenSizeReq) -> m.GetRequestExtraTokenSizeResp:
        return rt.target.extra_token_size(body)

    @app.post("/allocate_token_for_transfer_request")
    @MIGRATION
    def allocate_token_for_transfer_request(
        body: m.AllocateTokenForTransferReq, request: Request
    ) -> m.AllocateTokenForTransferResp:
        return rt.target.allocate(body, peer=request.client.host if request.client else "")

    @app.post("/transfer_request_kvcache")
    @MIGRATION
    def transfer_request_kvcache(body: m.TransferRequestKVCacheReq) -> m.TransferRequestKVCacheResp:
        return rt.source.transfer(body)

    @app.post("/commit_transfer_request_kvcache")
    @MIGRATION
    def commit_transfer_request_kvcache(body: m.CommitTransferReq) -> m.CommitTransferResp:
        return rt.target.commit(body)


def _add_data_plane(app: FastAPI, rt: Runtime) -> None:
    """kvmove's peer-to-peer data plane (only with --enable-kv-migration)."""

    @app.post("/kvmove/pull_kv")
    @MIGRATION
    def pull_kv(body: m.PullKVReq) -> m.PullKVResp:
        return rt.target.pull(body)

    @app.post(READ_PATH, response_class=Response)
    @MIGRATION
    async def read_pages(request: Request) -> Response:
        return await answer_read(request, rt.read_pages)


def _add_kvmove_routes(app: FastAPI, rt: Runtime) -> None:
    """kvmove's control routes: integrity and resources; with migration, its abort and the request hand-over."""

    @app.get("/kvmove/integrity")
    @ADMIN
    def integrity() -> Integrity:
        return rt.integrity()

    @app.get("/kvmove/resources")
    @ADMIN
    def resources() -> Resources:
        return rt.resources()

    if not rt.config.enable_kv_migration:
        return

    @app.post("/abort_transfer_request_kvcache")
    @MIGRATION
    def abort_transfer_request_kvcache(body: m.AbortTransferReq) -> m.AbortTransferResp:
        return rt.target.abort(body.migration_id)

    @app.post("/kvmove/hold_request")
    @MIGRATION
    def hold_request(body: HoldRequestReq) -> HoldRequestResp:
        return rt.held.hold(body)

    @app.post("/kvmove/release_request")
    @MIGRATION
    def release_request(body: ReleaseRequestReq) -> ReleaseRequestResp:
        return rt.held.release(body)


def _install_metrics(app: FastAPI, rt: Runtime) -> None:
    """``/metrics``: Prometheus text (``?format=json``: JSON); ``/metrics.json``: JSON, as scripts read it."""
    from kvmove.server.prometheus import CONTENT_TYPE, exposition, registry_for

    registry = registry_for(rt)

    @app.get("/metrics", response_model=None)
    @OPEN
    def metrics(request: Request, format: str = "prometheus") -> Metrics | Response:
        if format == "json":
            return rt.metrics(include_rids=getattr(request.state, ADMIN_STATE, False))
        return Response(exposition(registry), media_type=CONTENT_TYPE)  # NOTE: counts only, never request ids

    @app.get("/metrics.json")
    @OPEN
    def metrics_json(request: Request) -> Metrics:
        return rt.metrics(include_rids=getattr(request.state, ADMIN_STATE, False))


def _tokenize(rt: Runtime, body: TokenizeReq) -> TokenizeResp:
    max_len = rt.worker.pool.num_pages * rt.config.page_size
    if isinstance(body.prompt, str):
        tokens = rt.tokenizer.encode(body.prompt)
        return TokenizeResp(tokens=tokens, count=len(tokens), max_model_len=max_len)
    batch = [rt.tokenizer.encode(p) for p in body.prompt]
    return TokenizeResp(tokens=batch, count=[len(t) for t in batch], max_model_len=max_len)


def _failure(status: int, message: str, **extra: object) -> JSONResponse:
    return JSONResponse(status_code=status, content={"success": False, "message": message, **extra})


def _install_error_handlers(app: FastAPI) -> None:
    """Every failure answers ``{"success": false, "message": ...}``: bodies that do not parse or validate (400),
    unknown routes and methods (404, 405), refusals of the migration core and the worker, and bugs (500)."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cause = exc.__cause__  # NOTE: FastAPI raises "error parsing the body" from what the JSON decoder raised
        message = f"the request body could not be parsed: {_brief(cause)}" if cause is not None else str(exc.detail)
        return _failure(exc.status_code, message, code=exc.status_code)

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        return _failure(500, f"internal error: {_brief(exc)}")

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

    @app.exception_handler(RequestFailedError)
    async def failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return _failure(500, str(exc))

    @app.exception_handler(KvmoveError)
    async def refused(_: Request, exc: KvmoveError) -> JSONResponse:
        return _failure(400, str(exc))


def _brief(exc: BaseException) -> str:
    """One line naming ``exc`` (a too-deep body's RecursionError, a 5000-digit integer's ValueError)."""
    text = " ".join(str(exc).split(";")[0].split())  # NOTE: not Python's advice on raising its limits
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
