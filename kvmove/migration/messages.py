"""Typed wire messages of the KV-migration protocol (the SGLang fork's routes and kvmove's data plane), and the
base classes every wire message of a kvmove server shares; the server's own routes are ``kvmove.server.messages``.

The migration bodies mirror the public SGLang fork's ``io_types.py`` and ``http_server.py`` field by field (see
docs/notes/sglang-kv-migration.md), so a client written against those servers drives kvmove workers unchanged.
kvmove adds fields (never renames one): a handshake ``geometry``/``weight_version``/``transport`` per rank (and
``transport`` on a transfer's target entry, where a kvmove client copies it), and ``bytes``, ``seconds``,
``transport`` on the transfer answer.

Units: every ``*_token_size`` is page aligned; ``kv_indices`` are host **token slots** (``len == extra_token_size``,
whole pages in consecutive runs), as SGLang clients expect. kvmove's host pool addresses pages, so the target and
the source convert them with ``slots_to_pages`` and refuse anything that is not whole pages.
Request models ignore unknown keys (SGLang's ``BaseReq`` adds ``rid`` and ``http_worker_ipc``); their integers are
bounded to their widths and their strings must encode as UTF-8 (``fields``), so a malformed value is a 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvmove.migration.fields import Count, check_text


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _encodable(cls, value: Any) -> Any:
        return check_text(value)


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Failure(Response):
    """Body of every failed call, with a 4xx/5xx status."""

    success: bool = False
    message: str


# -- handshake: GET /get_transfer_session_ids --------------------------------------------------------------------


class Topology(Response):
    tp_size: int
    pp_size: int
    page_size: int


class GeometryInfo(BaseModel):
    """kvmove addition: what two peers must agree on before any byte moves. A tensor-parallel rank holds KV heads
    ``head_start .. head_start + num_kv_heads - 1`` of the model's ``total_kv_heads`` (0: it holds them all)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    head_start: int = 0
    total_kv_heads: int = 0


class RankSession(BaseModel):
    """One rank's transfer endpoint. kvmove's ``session_id`` is the rank's HTTP address ``host:port``."""

    model_config = ConfigDict(extra="ignore")

    tp: int
    pp: int
    session_id: str
    host_kv_data_ptrs: list[int]
    host_kv_item_lens: list[int]
    geometry: GeometryInfo | None = None
    weight_version: str | None = None
    transport: str | None = None


class TransferSessionIds(Response):
    topology: Topology
    ranks: list[RankSession]


# -- target: POST /get_request_extra_token_size, /allocate_token_for_transfer_request ---------------------------


class GetRequestExtraTokenSizeReq(Request):
    input_ids: list[Count]
    extra_key: str | None = None


class GetRequestExtraTokenSizeResp(Response):
    success: bool = True
    extra_token_size: int
    matched_token_size: int
    total_token_size: int


class AllocateTokenForTransferReq(Request):
    input_ids: list[Count]
    extra_key: str | None = None
    extra_token_size: Count = 0
    migration_id: str | None = Field(default=None, max_length=256)


class RankKVIndices(Response):
    tp: int
    pp: int
    kv_indices: list[int]


class AllocateTokenForTransferResp(Response):
    success: bool = True
    migration_id: str
    per_rank_kv_indices: list[RankKVIndices]


# -- source: POST /transfer_request_kvcache ------------------------------------------------------------------------


class TransferTarget(Request):
    """One target rank: the join of its ``RankSession`` and its ``RankKVIndices`` on ``(tp, pp)``. A kvmove client
    also copies the rank's ``transport`` and ``geometry`` (which KV heads it holds: the source then checks its
    layout exactly, also when the two workers split the heads differently)."""

    tp: Count
    pp: Count
    session_id: str
    host_kv_data_ptrs: list[Count]
    host_kv_item_lens: list[Count]
    kv_indices: list[Count]
    transport: str | None = None
    geometry: GeometryInfo | None = None


class TransferRequestKVCacheReq(Request):
    input_ids: list[Count]
    extra_key: str | None = None
    matched_token_size: Count = 0
    extra_token_size: Count = 0
    target_per_rank: list[TransferTarget] = Field(default_factory=list)


class TransferRequestKVCacheResp(Response):
    """kvmove additions: ``bytes`` moved, ``seconds`` of transport (the longest of the target ranks' pulls, which
    run at once), ``stage_seconds`` of device -> host copies on the source."""

    success: bool = True
    bytes: int = 0
    seconds: float = 0.0
    transport: str = ""
    stage_seconds: float = 0.0


# -- target: POST /commit_transfer_request_kvcache, /abort_transfer_request_kvcache (kvmove) -------------------


class CommitTransferReq(Request):
    migration_id: str = Field(default="", max_length=256)


class CommitTransferResp(Response):
    """kvmove addition: ``load_seconds`` of host -> device copies on the target."""

    success: bool = True
    matched_after_commit: int
    message: str = ""
    load_seconds: float = 0.0


class AbortTransferReq(Request):
    migration_id: str = Field(max_length=256)


class AbortTransferResp(Response):
    success: bool = True
    released_pages: int


# -- kvmove data plane: POST /kvmove/pull_kv (target pulls from the source's host pool) --------------------------
# (over the http transport the target then reads the pages by POST /kvmove/read_pages on the source, a raw-bytes
# route whose JSON body is ``kvmove.transport.http.ReadRequest``)


class BufferInfo(Request):
    """One staged source buffer. ``address`` (its address in the source's memory) only where the transport reads by
    address (NIXL, sent to the authenticated target); over http the buffer is named by ``buffer_id`` alone and the
    key is absent from the body."""

    endpoint: str
    buffer_id: Count
    nbytes: Count
    address: Count | None = Field(default=None, exclude_if=lambda v: v is None)


class SourceEndpoint(Request):
    """The source rank's transport endpoint: ``endpoint_info`` is its ``EndpointInfo`` payload, base64."""

    session_id: str
    transport: str
    endpoint: str
    endpoint_info: str
    buffers: list[BufferInfo]
    geometry: GeometryInfo
    weight_version: str


class PullSource(Request):
    """One source rank the target rank may read from: its staged ``src_pages`` (one per page to send, in order)."""

    tp: Count
    pp: Count
    src_pages: list[Count]
    endpoint: SourceEndpoint


class PullKVReq(Request):
    """Sent by the source to each target rank ``(tp, pp)`` it was told about. That rank pulls only into the host
    slots it allocated for the pending migration whose ``kv_indices``, tokens and namespace equal these, and reads
    from ``sources`` only the KV heads it holds (all of one source rank's pages when both split heads alike)."""

    input_ids: list[Count]
    extra_key: str | None = None
    matched_token_size: Count
    kv_indices: list[Count]
    tp: Count = 0
    pp: Count = 0
    sources: list[PullSource]
    checksum: str = Field(max_length=128)  # ``kvcache.checksum`` of every source rank's staged pages, all heads


class PullKVResp(Response):
    success: bool = True
    migration_id: str
    bytes: int
    seconds: float
    transport: str
