"""Public request/response types: SamplingParams in, RequestOutput and StreamDelta out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from minisgl_backend.errors import InvalidSamplingParamsError
from minisgl_backend.validation import (
    SEED_LIMIT,
    Spec,
    check_callables,
    check_int_sequence,
    check_logit_bias,
    check_str_sequence,
    validate_fields,
)

# A temperature below this is greedy (argmax): dividing logits by a smaller one only overflows.
GREEDY_EPSILON = 1e-5
FinishReason = Literal["stop", "length", "abort"]
# (output token ids so far, float32 CPU logits row [vocab]) -> logits row to sample from.
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request (vLLM-compatible names).

    temperature 0 means greedy, and so does any temperature below GREEDY_EPSILON (1e-5). top_k 0
    (or -1) and top_p 1 and min_p 0 disable those filters. `seed` (0 <= seed < 2**64) fixes the
    random draws: the token at absolute position p is chosen with noise derived from
    hash(seed, p, token id) only, so it does not depend on batching or chunking (no shared RNG).
    `logprobs=k` returns the sampled token's logprob plus the k most likely alternatives;
    `prompt_logprobs=k` does the same for prompt tokens from index `prompt_logprobs_start` on.
    `logprobs` / `prompt_logprobs` are capped by the engine's `max_logprobs` (checked at submit).
    Penalties (vLLM's semantics, applied to the logits before temperature, top-k/p and min-p, so a
    greedy request sees them too): `logit_bias` (token id -> bias in [-100, 100], added to the
    logit), then `repetition_penalty` (> 0, 1 = off) on every token of the prompt or the output so
    far (a positive logit is divided by it, any other multiplied), then `frequency_penalty` ([-2, 2])
    times the token's count in the output, then `presence_penalty` ([-2, 2]) once for every token in
    the output, both subtracted. logit_bias ids must be < the vocabulary size (checked at the first
    draw: the request fails with InvalidSamplingParamsError). Logprobs stay those of the raw model.
    `logits_processors` run on the engine's copy thread before the draw (e.g. constrained decoding);
    one that raises (anything, SystemExit included) or returns an unusable row (not a float tensor
    of the vocabulary's shape, NaN or +inf, or nothing left to draw) ends only its own request, with
    a RequestFailedError chaining the cause. A processor must not call blocking engine methods
    (ReentrantCallError).
    `n` (an int >= 1) draws n samples of the prompt in parallel; they share the prompt's full KV
    blocks through the prefix cache (it is computed once; each sample recomputes only the prompt's
    last, partial block). Sample 0 is drawn with the request's seed, sample i > 0 with
    `sample_key(seed, i)` (the i-th output of SplitMix64 seeded with it), so sample i is the same
    whatever n, the batch or the chunking, and replays alone as an n = 1 request with that seed
    (its RequestOutput.seed). The request's RequestOutput is sample 0, with every sample in
    `.samples`; stream deltas carry their sample's `index`.
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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias; a dict (or (id, bias) pairs) is stored as sorted (id, bias) pairs (hashable)
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1

    def __post_init__(self) -> None:
        err = InvalidSamplingParamsError
        # Accept lists / a single string for convenience, store tuples so params stay hashable.
        object.__setattr__(self, "stop", check_str_sequence("stop", self.stop, err))
        object.__setattr__(
            self, "stop_token_ids", check_int_sequence("stop_token_ids", self.stop_token_ids, err)
        )
        object.__setattr__(
            self, "logits_processors", check_callables("logits_processors", self.logits_processors, err)
        )
        object.__setattr__(self, "logit_bias", check_logit_bias("logit_bias", self.logit_bias, err))
        if self.top_k == -1 and not isinstance(self.top_k, bool):
            object.__setattr__(self, "top_k", 0)
        validate_fields(self, _SPECS, err)
        if any(t < 0 for t in self.stop_token_ids):
            raise err(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def penalised(self) -> bool:
        """Whether the logits change before the draw (logit_bias or any penalty away from neutral)."""
        return (
            bool(self.logit_bias)
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidSamplingParamsError unless every logit_bias token id is in [0, vocab_size)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidSamplingParamsError(
                f"logit_bias token ids out of range [0, {vocab_size}) (the vocabulary): {bad[:5]}"
            )

    @classmethod
    def check_value(cls, field: str, value: Any, label: str | None = None) -> Any:
        """Check one value against `field`'s rule (for adapters that must look at a raw value before
        their framework casts it); returns it normalised or raises InvalidSamplingParamsError."""
        return _SPECS[field].check(label or field, value, InvalidSamplingParamsError)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise InvalidSamplingParamsError(
                f"unknown sampling parameter(s) {unknown}; valid: {', '.join(names)}"
            )
        return cls(**values)


_SPECS: dict[str, Spec] = {
    "temperature": Spec("float", lo=0, note=f"0, or anything below {GREEDY_EPSILON}, is greedy"),
    "top_p": Spec("float", lo=0, hi=1, lo_open=True),
    "top_k": Spec("int", lo=0, note="0 or -1 = off"),
    "min_p": Spec("float", lo=0, hi=1),
    "seed": Spec("int", lo=0, hi=SEED_LIMIT, hi_open=True, optional=True),
    "max_tokens": Spec("int", lo=1),
    "ignore_eos": Spec("bool"),
    "logprobs": Spec("int", lo=0, optional=True, note="capped by the engine's max_logprobs"),
    "prompt_logprobs": Spec("int", lo=0, optional=True, note="capped by the engine's max_logprobs"),
    "prompt_logprobs_start": Spec("int", lo=1, note="token 0 has no context"),
    "skip_special_tokens": Spec("bool"),
    "repetition_penalty": Spec("float", lo=0, lo_open=True, note="1 = off"),
    "presence_penalty": Spec("float", lo=-2, hi=2, note="0 = off"),
    "frequency_penalty": Spec("float", lo=-2, hi=2, note="0 = off"),
    "n": Spec("int", lo=1, note="parallel samples of the prompt"),
}


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
    scheduled: float | None = None  # first admission (it got KV blocks): scheduled - arrival is queue time
    token_times: tuple[float, ...] = ()  # when each output token was committed (first = first_token)

    @property
    def inter_token_latencies(self) -> list[float]:
        """The gaps between consecutive output tokens (ITL), one per token after the first."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(frozen=True)
class RequestOutput:
    """The finished result of one request: one sample of it (`index`), and for the request itself
    its sample 0, which equals the output of the same request with n = 1, so code that reads
    `.text` or `.token_ids` is unchanged by n. `samples` holds all n samples in index order."""

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
    index: int = 0  # which of the request's n samples this is
    # Samples 1..n-1 when this is an n > 1 request's output (sample 0); read them through `samples`.
    more_samples: tuple[RequestOutput, ...] = ()

    @property
    def samples(self) -> tuple[RequestOutput, ...]:
        """Every sample of the request in index order, this one first: (self,) when n = 1."""
        return (self, *self.more_samples)


@dataclass(frozen=True)
class StreamDelta:
    """What one request produced since its previous delta (text held back while it may be a stop string)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked
    index: int = 0  # the sample (of the request's n) these tokens belong to; `finished` is that sample's
