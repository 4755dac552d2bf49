"""Request intake: a caller's prompt and sampling params turned into the Requests the scheduler runs.

It runs on the caller's thread, so every check here fails that caller alone and a bad request never
reaches the scheduler thread: the prompt (text or token ids, its length against the context limit),
the params against this model (vocabulary, the logprobs cap), the request id. A request without a
seed gets one drawn here, which its output reports so that the sample can be replayed.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import random
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from minisgl_backend.handle import RequestHandle
from minisgl_backend.sampling.sampler import sample_key
from minisgl_backend.scheduler.request import Request, SampleGroup
from minisgl_backend.types import LogitsProcessor, SamplingParams
from minisgl_backend.validation import check_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | Sequence[int]
ParamsLike = SamplingParams | dict | None


def as_params(params: ParamsLike) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise InvalidSamplingParamsError(f"expected SamplingParams or dict, got {type(params).__name__}")


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """`Engine.generate`'s prompts as a list: one prompt (a string or a list of token ids) or many."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast("Prompt", prompts)]  # one prompt: a string, or token ids
    return list(cast("Sequence[Prompt]", prompts))


def as_params_list(params: ParamsLike | Sequence[ParamsLike], n: int) -> list[SamplingParams]:
    """`Engine.generate`'s params for `n` prompts: one for all, or one per prompt."""
    if isinstance(params, (list, tuple)):
        if len(params) != n:
            raise InvalidSamplingParamsError(f"{len(params)} sampling params for {n} prompts")
        return [as_params(p) for p in params]
    return [as_params(cast("ParamsLike", params))] * n  # not a list or tuple: one for all


def own_processors(params: SamplingParams) -> SamplingParams:
    """`params` for one sequence: each logits processor that has a `fork()` (a stateful one, such as a
    grammar's parser) replaced by a fork of it, so the n samples of a request and the prompts that
    share one SamplingParams never advance each other's state."""
    procs = params.logits_processors
    if not any(callable(getattr(p, "fork", None)) for p in procs):
        return params
    return dataclasses.replace(params, logits_processors=tuple(_forked(p) for p in procs))


def _forked(processor: LogitsProcessor) -> LogitsProcessor:
    fork = getattr(processor, "fork", None)
    return fork() if callable(fork) else processor


class RequestIntake:
    """Validates and builds requests for one engine; safe to call from any number of threads."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase,
        detok_tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        eos_ids: frozenset[int],
        engine_threads: frozenset[threading.Thread],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = config.max_logprobs
        self._detok_tokenizer = detok_tokenizer  # the scheduler thread's own copy
        self._eos_ids = eos_ids
        self._engine_threads = engine_threads
        self._encode_lock = threading.Lock()
        self._seed_lock = threading.Lock()
        self._seed_rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self._ids = itertools.count()

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            check_text("the prompt", prompt, InvalidRequestError)
            with self._encode_lock:
                return list(self.tokenizer.encode(prompt))
        if (
            isinstance(prompt, (bytes, bytearray, memoryview))
            or not isinstance(prompt, Sequence)
            or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)
        ):
            kind = type(prompt).__name__
            raise InvalidRequestError(
                f"a prompt must be a string or a list of int token ids, got {kind}"
                + (" (decode bytes to str first)" if isinstance(prompt, bytes) else "")
            )
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def make_requests(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None, owner: str | None = None
    ) -> tuple[Request, ...]:
        """The request's params.n samples (one Request each, sample i keyed by sample_key(seed, i)),
        with one handle and one SampleGroup between them."""
        ids = self.tokenize(prompt)
        if not ids:
            raise EmptyPromptError("the prompt is empty (it has no tokens)")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but the context limit (max_model_len) "
                f"is {self.max_model_len}"
            )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise InvalidSamplingParamsError(
                f"stop_token_ids out of range [0, {self.vocab_size}): {bad_stop}"
            )
        params.check_vocab(self.vocab_size)
        cap = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > cap:
                raise InvalidSamplingParamsError(
                    f"{name} must be in [0, {cap}] (the engine's max_logprobs setting), got {k}"
                )
        seed = params.seed
        if seed is None:  # reported in the output so the sample can be replayed
            with self._seed_lock:
                seed = self._seed_rng.getrandbits(63)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidRequestError(f"request_id must be a non-empty string or None, got {request_id!r}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        handle = RequestHandle(rid, params.n)
        handle._engine_threads = self._engine_threads
        group = SampleGroup(params.n)
        return tuple(
            Request(
                rid,
                ids,
                own_processors(params),
                sample_key(seed, i),
                self._eos_ids,
                self._detok_tokenizer,
                handle,
                i,
                group,
                owner,
            )
            for i in range(params.n)
        )
