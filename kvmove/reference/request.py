"""A generation request: its tokens, sampling parameters, priority, prefix-cache namespace and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvmove.errors import KvmoveError


class RequestError(KvmoveError):
    """A request the worker refuses: empty prompt, token id outside the vocabulary, bad sampling parameters."""


class UnknownRequestError(RequestError):
    """No request with this rid is waiting or running on the worker."""


class RequestFailedError(KvmoveError):
    """A request that raised while the worker stepped it; it alone was finished, the rest of its batch ran on."""


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(enum.Enum):
    STOP = "stop"  # sampled a stop token
    LENGTH = "length"  # reached max_new_tokens
    ABORT = "abort"
    ERROR = "error"  # raised while being stepped (``Request.error`` says what); its batch ran on


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; otherwise sampling draws from a generator seeded with ``seed``."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature < float("inf"):
            raise RequestError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not -(1 << 63) <= self.seed < 1 << 64:
            raise RequestError(f"seed must fit in 64 bits, got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(eq=False)
class Request:
    """One sequence. ``output_ids`` may be non-empty at submission: a resumed request continues after them.

    Progress counters are per worker: ``cached_tokens`` came from the prefix cache at admission,
    ``computed_tokens`` went through the model here.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    extra_key: str | None = None
    output_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    computed_tokens: int = 0
    kv_len: int = 0  # tokens whose K/V is in the pool (all_ids[:kv_len])
    generator: torch.Generator | None = field(default=None, repr=False)
    error: str = ""

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        self.output_ids = [int(t) for t in self.output_ids]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    @property
    def max_kv_tokens(self) -> int:
        """Tokens whose K/V this request can ever need: every token but the last one it will sample."""
        return self.num_tokens + self.remaining_new_tokens - 1

    @property
    def finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError unless the request can run on a model of ``vocab_size`` tokens."""
        if not self.rid:
            raise RequestError("a request needs a non-empty rid")
        if not self.prompt_ids:
            raise RequestError(f"request {self.rid!r}: empty prompt")
        bad = [t for t in self.all_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"request {self.rid!r}: token ids {bad[:8]} outside the vocabulary [0, {vocab_size})")
        if self.remaining_new_tokens < 1:
            raise RequestError(f"request {self.rid!r}: already has max_new_tokens={self.sampling.max_new_tokens}")

    def sampler(self) -> torch.Generator:
        """The request's own generator (seeded on first use); its state moves with ``continuation``."""
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)
        return self.generator

    def continuation(self) -> Request:
        """A fresh copy that resumes this request elsewhere: same tokens so far, sampling state and priority."""
        gen = None
        if self.generator is not None:
            gen = torch.Generator()
            gen.set_state(self.generator.get_state())
        return Request(
            rid=self.rid,
            prompt_ids=list(self.prompt_ids),
            sampling=self.sampling,
            priority=self.priority,
            extra_key=self.extra_key,
            output_ids=list(self.output_ids),
            generator=gen,
        )
