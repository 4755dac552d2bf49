"""Public request/response types: SamplingParams in, RequestOutput and StreamDelta out."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch

from minisgl_backend.errors import InvalidSamplingParamsError

FinishReason = Literal["stop", "length", "abort"]
# (output token ids so far, float32 CPU logits row [vocab]) -> logits row to sample from.
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request (vLLM-compatible names).

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    `seed` fixes the random draws: the token at absolute position p is chosen with noise derived
    from hash(seed, p, token id) only, so it does not depend on batching or chunking (S8).
    `logprobs=k` returns the sampled token's logprob plus the k most likely alternatives;
    `prompt_logprobs=k` does the same for prompt tokens from index `prompt_logprobs_start` on.
    `logits_processors` run on the scheduler thread before the draw (e.g. constrained decoding);
    one that raises ends only its own request, with that exception.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    skip_special_tokens: bool = True
    logits_processors: tuple[LogitsProcessor, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience, store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidSamplingParamsError(msg)

        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be 0/-1 (disabled) or a positive int, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be a non-negative int or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must hold non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                bad(f"{name} must be None or a non-negative int, got {v!r}")
        if any(not callable(f) for f in self.logits_processors):
            bad("logits_processors must be callables (output_ids, logits) -> logits")
        if self.prompt_logprobs_start < 1:
            bad(f"prompt_logprobs_start must be >= 1 (token 0 has no context), got {self.prompt_logprobs_start}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise InvalidSamplingParamsError(
                f"unknown sampling parameter(s) {unknown}; valid: {', '.join(names)}"
            )
        return cls(**values)


class TokenLogprob(NamedTuple):
    """Log-probability of one token under the model's raw (temperature-free) distribution.

    rank is 1 when the token is the argmax (lm-eval's is_greedy); `top` holds the k most likely
    (token id, logprob) pairs in descending order.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestTimings:
    """Wall-clock times (time.perf_counter seconds) of one request's life."""

    arrival: float
    first_token: float | None
    finish: float | None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(frozen=True)
class RequestOutput:
    """The finished result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    seed: int
    timings: RequestTimings
    logprobs: list[TokenLogprob] | None = None
    # One entry per prompt token; None before prompt_logprobs_start (token 0 never has one).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_preemptions: int = 0


@dataclass(frozen=True)
class StreamDelta:
    """What one request produced since its previous delta (text held back while it may be a stop string)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
