"""Public request/response types: SamplingParams in, RequestOutput and StreamDelta out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch

from minisgl_backend.errors import InvalidSamplingParamsError
from minisgl_backend.validation import (
    LOGIT_BIAS_LIMIT,
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


# The front ends that take sampling parameters from their users: the HTTP server's request bodies,
# LangChain's MiniSGL / ChatMiniSGL fields and per-call options, lm-eval's gen_kwargs and the
# `minisgl generate` flags. Each derives its fields from SamplingParams's (sampling_fields).
Surface = Literal["server", "langchain", "lm_eval", "cli"]
SURFACES: tuple[Surface, ...] = get_args(Surface)


class SamplingField(NamedTuple):
    """One SamplingParams field as its front ends see it: the single place its default, accepted
    values, description and reach are written (`sampling_field` in the class body)."""

    name: str
    default: Any
    spec: Spec | None  # the scalar rule (bounds, kind); None for a sequence with its own check
    doc: str  # one line: what the field does
    accepts: str  # the accepted values in words (the spec's description for scalar fields)
    surfaces: frozenset[Surface]  # the front ends that offer it
    wire: Any  # the JSON / pydantic type a front end declares for it

    def bounds(self) -> dict[str, float]:
        """The spec's bounds as pydantic / JSON-schema constraints (ge, gt, le, lt)."""
        spec, out = self.spec, {}
        if spec is not None and spec.lo is not None:
            out["gt" if spec.lo_open else "ge"] = spec.lo
        if spec is not None and spec.hi is not None:
            out["lt" if spec.hi_open else "le"] = spec.hi
        return out


_WIRE_OF_KIND: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str}


def sampling_field(
    default: Any,
    spec: Spec | None = None,
    doc: str = "",
    *,
    accepts: str = "",
    wire: Any = None,
    surfaces: Sequence[Surface] = SURFACES,
) -> Any:
    """A SamplingParams field with what every front end needs to know of it. A new field declared
    with this reaches the server, LangChain, lm-eval and the CLI (`surfaces` narrows that) with
    these bounds and this doc, and is checked by `spec` in the Python API."""
    if not doc:
        raise TypeError("a sampling field needs a one-line doc")
    if spec is None and not accepts:
        raise TypeError("a sampling field without a spec needs `accepts` (its values in words)")
    if spec is None and wire is None and surfaces:
        raise TypeError("a sampling field without a spec that front ends offer needs its `wire` type")
    if wire is None:
        wire = _WIRE_OF_KIND[spec.kind] if spec is not None else None
    info = {"spec": spec, "doc": doc, "accepts": accepts, "wire": wire, "surfaces": frozenset(surfaces)}
    return dataclasses.field(default=default, metadata={"sampling": info})


_FIELDS_OF: dict[type, dict[str, SamplingField]] = {}


def sampling_fields(cls: type[SamplingParams] | None = None) -> dict[str, SamplingField]:
    """Every field of SamplingParams (or of a subclass that declares more), in declaration order."""
    cls = SamplingParams if cls is None else cls
    found = _FIELDS_OF.get(cls)
    if found is None:
        found = {}
        for f in dataclasses.fields(cls):
            info = f.metadata.get("sampling")
            if info is None:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with sampling_field()")
            spec = info["spec"]
            accepts = info["accepts"] or (spec.describe() if spec is not None else "")
            found[f.name] = SamplingField(
                f.name, f.default, spec, info["doc"], accepts, info["surfaces"], info["wire"]
            )
        _FIELDS_OF[cls] = found
    return found


def surface_fields(surface: Surface, cls: type[SamplingParams] | None = None) -> dict[str, SamplingField]:
    """The fields `surface` offers, in declaration order."""
    return {k: f for k, f in sampling_fields(cls).items() if surface in f.surfaces}


def _specs_of(cls: type[SamplingParams]) -> dict[str, Spec]:
    specs = _SPECS_OF.get(cls)
    if specs is None:
        specs = {k: f.spec for k, f in sampling_fields(cls).items() if f.spec is not None}
        _SPECS_OF[cls] = specs
    return specs


_SPECS_OF: dict[type, dict[str, Spec]] = {}


def pydantic_fields(
    fields: Mapping[str, SamplingField],
    defaults: Mapping[str, Any] | None = None,
    nullable: bool = False,
    narrow: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """`fields` as pydantic.create_model field definitions: the wire type, the spec's bounds (NaN and
    infinities refused for floats), the default (`defaults` overrides it per field) and the doc as the
    description, so a JSON schema carries them. `nullable`: every field also takes None (the caller
    then means the engine's default). `narrow`: extra Field constraints of one front end."""
    from pydantic import Field

    out: dict[str, Any] = {}
    for name, f in fields.items():
        wire = f.wire
        default = (defaults or {}).get(name, f.default)
        if isinstance(default, tuple):  # a sequence field: a front end's list, absent by default
            default = None
        if nullable or default is None or (f.spec is not None and f.spec.optional):
            wire = wire | None
        extra: dict[str, Any] = {**f.bounds(), **(narrow or {}).get(name, {})}
        if f.spec is not None and f.spec.kind == "float":
            extra["allow_inf_nan"] = False
        out[name] = (wire, Field(default, description=f.doc, **extra))
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request (vLLM-compatible names).

    Each field is declared with `sampling_field`: its default, accepted values (`Spec`), one-line doc
    and the front ends that offer it, which derive their own fields from these declarations
    (docs/sampling.md). What the declarations do not say:

    `seed` fixes the random draws: the token at absolute position p is chosen with noise derived from
    hash(seed, p, token id) only, so it does not depend on batching or chunking (no shared RNG).
    `logprobs` / `prompt_logprobs` are capped by the engine's `max_logprobs` (checked at submit).
    Penalties (vLLM's semantics, applied to the logits before temperature, top-k/p and min-p, so a
    greedy request sees them too), in this order: `logit_bias`, `repetition_penalty` on every token of
    the prompt or the output so far, `frequency_penalty` times the token's count in the output,
    `presence_penalty` once for every token in the output. logit_bias ids must be < the vocabulary
    size (checked at the first draw: the request fails with InvalidSamplingParamsError). Logprobs stay
    those of the raw model.
    `logits_processors` run on the engine's copy thread before the draw (e.g. constrained decoding);
    one that raises (anything, SystemExit included) or returns an unusable row (not a float tensor
    of the vocabulary's shape, NaN or +inf, or nothing left to draw) ends only its own request, with
    a RequestFailedError chaining the cause. A processor must not call blocking engine methods
    (ReentrantCallError).
    `n` draws n samples of the prompt in parallel; they share the prompt's full KV blocks through the
    prefix cache (it is computed once; each sample recomputes only the prompt's last, partial block).
    Sample 0 is drawn with the request's seed, sample i > 0 with `sample_key(seed, i)` (the i-th
    output of SplitMix64 seeded with it), so sample i is the same whatever n, the batch or the
    chunking, and replays alone as an n = 1 request with that seed (its RequestOutput.seed). The
    request's RequestOutput is sample 0, with every sample in `.samples`; stream deltas carry their
    sample's `index`.
    """

    temperature: float = sampling_field(
        1.0,
        Spec("float", lo=0, note=f"0, or anything below {GREEDY_EPSILON}, is greedy"),
        "Divides the logits before the draw; 0 (or anything below 1e-5) is greedy (argmax).",
    )
    top_p: float = sampling_field(
        1.0,
        Spec("float", lo=0, hi=1, lo_open=True),
        "Draw from the smallest set of most likely tokens whose probabilities sum to top_p; 1 = off.",
    )
    top_k: int = sampling_field(
        0,
        Spec("int", lo=-1, note="0 or -1 = off"),
        "Draw from the top_k most likely tokens; 0 or -1 = off.",
    )
    min_p: float = sampling_field(
        0.0,
        Spec("float", lo=0, hi=1),
        "Drop the tokens less likely than min_p times the most likely one; 0 = off.",
    )
    seed: int | None = sampling_field(
        None,
        Spec("int", lo=0, hi=SEED_LIMIT, hi_open=True, optional=True),
        "Keys the draws (noise from a hash of seed, position and token id); None: the engine picks one.",
    )
    max_tokens: int = sampling_field(16, Spec("int", lo=1), "The most tokens to generate.")
    stop: tuple[str, ...] = sampling_field(
        (),
        doc="Strings that end the output where they first appear (left out of the text).",
        accepts="a string or a list of non-empty strings",
        wire=list[str],
    )
    stop_token_ids: tuple[int, ...] = sampling_field(
        (),
        doc="Token ids that end the output (as the end-of-sequence token does).",
        accepts="a list of token ids (ints >= 0)",
        wire=list[int],
    )
    ignore_eos: bool = sampling_field(
        False, Spec("bool"), "Keep generating past the end-of-sequence token (up to max_tokens)."
    )
    logprobs: int | None = sampling_field(
        None,
        Spec("int", lo=0, optional=True, note="capped by the engine's max_logprobs"),
        "Return each output token's logprob with those of the k = logprobs most likely tokens.",
        surfaces=("server",),
    )
    prompt_logprobs: int | None = sampling_field(
        None,
        Spec("int", lo=0, optional=True, note="capped by the engine's max_logprobs"),
        "The same for the prompt's tokens from prompt_logprobs_start on.",
        surfaces=(),
    )
    prompt_logprobs_start: int = sampling_field(
        1,
        Spec("int", lo=1, note="token 0 has no context"),
        "The first prompt token that gets prompt logprobs.",
        surfaces=(),
    )
    skip_special_tokens: bool = sampling_field(
        True, Spec("bool"), "Leave special tokens out of the decoded text."
    )
    logits_processors: tuple[LogitsProcessor, ...] = sampling_field(
        (),
        doc="Callables (output ids, logits row) -> logits row, run before the draw.",
        accepts="a list of callables",
        surfaces=(),
    )
    repetition_penalty: float = sampling_field(
        1.0,
        Spec("float", lo=0, lo_open=True, note="1 = off"),
        "vLLM's: a positive logit of a token in the prompt or output is divided by it, others "
        "multiplied; 1 = off.",
    )
    presence_penalty: float = sampling_field(
        0.0,
        Spec("float", lo=-2, hi=2, note="0 = off"),
        "Subtracted once from the logit of every token already in the output; 0 = off.",
    )
    frequency_penalty: float = sampling_field(
        0.0,
        Spec("float", lo=-2, hi=2, note="0 = off"),
        "Times each token's count in the output, subtracted from its logit; 0 = off.",
    )
    # a dict (or (id, bias) pairs) is stored as sorted (id, bias) pairs, so params stay hashable
    logit_bias: tuple[tuple[int, float], ...] = sampling_field(
        (),
        doc="Token id -> bias, added to the token's logit before the draw (greedy decoding sees it).",
        accepts=f"a dict token id (int >= 0) -> bias in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
        wire=dict[int, float],
        surfaces=("server", "langchain", "lm_eval"),
    )
    n: int = sampling_field(
        1,
        Spec("int", lo=1, note="parallel samples of the prompt"),
        "Samples of the prompt drawn in parallel (sample i keyed by seed and i).",
        surfaces=("server", "langchain"),
    )

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
        validate_fields(self, _specs_of(type(self)), err)
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
        return _specs_of(cls)[field].check(label or field, value, InvalidSamplingParamsError)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
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
