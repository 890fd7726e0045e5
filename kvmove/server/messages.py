"""Typed wire messages of a kvmove server's own routes: generation (SGLang's ``/generate`` body), the tokenizer,
metrics, resources, integrity, health, ``/abort_request``, and kvmove's request hand-over (hold, release, resume)
that a migration of a running request uses.

The KV-migration protocol's messages (SGLang fork's routes, kvmove's data plane) and the wire base classes are
``kvmove.migration.messages``; the bounded field types are ``kvmove.migration.fields``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from kvmove.migration.fields import Count, Int64, PositiveCount, Probability, Seconds, Seed, Temperature
from kvmove.migration.messages import Request, Response

# -- kvmove request hand-over: POST /kvmove/hold_request, /kvmove/release_request (source) -----------------------


class SamplingParamsMsg(Request):
    """SGLang's sampling params, the subset kvmove's worker runs (defaults as SGLang's)."""

    max_new_tokens: PositiveCount = 128
    temperature: Temperature = 1.0
    top_p: Probability = 1.0
    top_k: Int64 = -1
    stop_token_ids: list[Count] | None = None
    ignore_eos: bool = False
    sampling_seed: Seed | None = None


class ResumeState(BaseModel):
    """Everything a request needs to continue elsewhere: tokens so far, sampling state, priority, namespace."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    sampling_params: SamplingParamsMsg
    priority: int = 0
    extra_key: str | None = None
    generator_state: str | None = None


class HoldRequestReq(Request):
    rid: str = Field(max_length=1024)


class HoldRequestResp(Response):
    """``input_ids``: the whole-page prefix whose K/V the source holds (locked) for this request: migrate these."""

    success: bool = True
    rid: str
    input_ids: list[int]
    request: ResumeState


class AbortRequestReq(Request):
    """SGLang's ``/abort_request`` body (``AbortReq``)."""

    rid: str = Field(default="", max_length=1024)
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class ReleaseRequestReq(Request):
    rid: str = Field(max_length=1024)
    migrated: bool
    target: str = ""


class ReleaseRequestResp(Response):
    success: bool = True
    rid: str
    state: str


# -- generation, tokenizer, metrics --------------------------------------------------------------------------------


class ResumeInfo(Request):
    output_ids: list[Count]
    generator_state: str | None = None


class GenerateReq(Request):
    text: str | None = None
    input_ids: list[Count] | None = None
    rid: str | None = Field(default=None, max_length=1024)
    sampling_params: SamplingParamsMsg = Field(default_factory=SamplingParamsMsg)
    stream: bool = False
    priority: Int64 | None = None
    extra_key: str | None = None
    resume: ResumeInfo | None = None
    timeout: Seconds | None = None  # kvmove: seconds until the request is aborted (default: --request-timeout)


class GenerateResp(Response):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class TokenizeReq(Request):
    model: str = "default"
    prompt: str | list[str]
    add_special_tokens: bool = True


class TokenizeResp(Response):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeReq(Request):
    tokens: list[Count]
    skip_special_tokens: bool = True


class DetokenizeResp(Response):
    text: str


class Metrics(Response):
    """``transport``: the KV data plane between servers ("" without migration); ``transport_note``: why ``auto``
    fell back to the slower ``http`` ("" when it did not)."""

    waiting_per_priority: dict[str, int]
    waiting_rids: dict[str, list[str]]
    running: int
    running_rids: list[str]
    held_rids: list[str]
    free_pages: int
    used_pages: int
    cached_pages: int
    total_pages: int
    page_size: int
    host_free_pages: int
    migrations_pending: int
    weight_version: str
    transport: str = ""
    transport_note: str = ""
    rids_hidden: bool = False  # request ids withheld: the caller did not present the admin key


class Resources(Response):
    """What a server holds now (``/kvmove/resources``): its process (fds, resident bytes, threads, -1 where the
    platform does not say), its pools and locks, and migration state. A soak compares these before and after."""

    fds: int
    rss_bytes: int
    threads: int
    device_used_pages: int
    device_locked_pages: int
    export_locks: int
    host_used_pages: int
    outbox_used_pages: int
    migrations_pending: int
    held_requests: int
    inflight_requests: int
    open_grants: int


class Integrity(Response):
    success: bool = True
    ok: bool
    message: str = ""


class Health(Response):
    status: str = "ok"


class FlushCacheResp(Response):
    success: bool = True
    freed_pages: int
