"""Scheduler-side state of one request: owned by the scheduler thread only, so it
needs no lock and no worker can see it change mid-iteration.

Its fields, by concern: identity and parameters (fixed at submit); the committed sequence and its
text (`output_ids`, `detok`, logprobs); KV ownership (`table_row`, `block_table`); planning state,
which runs ahead of results under overlap (`num_computed`, `pending_samples`,
`last_sample_iteration`, `epoch`); prefix-cache bookkeeping (`num_readonly_blocks`,
`num_offered_blocks`, `claims`); and the outcome (`finish_reason`, `error`), which only
`Scheduler.finish` sets.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from minisgl_backend.handle import RequestHandle
from minisgl_backend.kvcache.prefix_cache import prefix_hashes
from minisgl_backend.scheduler.detokenizer import IncrementalDetokenizer
from minisgl_backend.types import (
    FinishReason,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # no KV yet (new, or preempted for recompute)
    RUNNING = "running"  # holds KV blocks: prefilling chunks or decoding
    FINISHED = "finished"


class SampleGroup:
    """The n samples of one request (SamplingParams.n): one Request each, one handle between them.
    Collects their outputs as they finish and assembles the request's RequestOutput once all have.
    Scheduler thread only, like its requests."""

    def __init__(self, n: int) -> None:
        self.outputs: list[RequestOutput | None] = [None] * n
        self.unfinished = n  # samples not yet finished (delivered or failed)
        self.error: Exception | None = None  # the first sample's failure fails the whole request

    def result(self) -> RequestOutput:
        """Sample 0 carrying the others; every sample gets sample 0's prompt logprobs (only sample 0
        scores the prompt, so the others can share its cached blocks)."""
        first, *rest = self.outputs
        assert first is not None and all(o is not None for o in rest)
        more = tuple(
            dataclasses.replace(o, prompt_logprobs=first.prompt_logprobs) for o in rest if o is not None
        )
        return dataclasses.replace(first, more_samples=more) if more else first


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        eos_ids: frozenset[int],
        tokenizer,
        handle: RequestHandle,
        index: int = 0,
        group: SampleGroup | None = None,
        owner: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed  # this sample's sampling key (sampling.sampler.sample_key)
        self.handle = handle
        self.index = index  # which of the request's params.n samples this is
        self.group = group if group is not None else SampleGroup(1)
        # Whose share of admission this takes (Scheduler's fair policy): the submitter's key, or
        # the request itself, so the n samples of one prompt count as one.
        self.owner = owner if owner is not None else request_id
        self.arrival = time.perf_counter()
        self.token_times: list[float] = []  # commit time of each output token
        self.scheduled_time: float | None = None  # first admission; a re-admission keeps it
        self.status = RequestStatus.WAITING
        self.output_ids: list[int] = []  # committed: results the scheduler has processed
        self.block_table: list[int] = []
        self.table_row: int | None = None  # token-table row, held from admission to finish
        # Planning runs ahead of results (overlap): these count work submitted but maybe not done.
        self.num_computed = 0  # positions whose K/V computation has been submitted
        self.pending_samples = 0  # submitted iterations that will draw a token for this request
        self.last_sample_iteration = 0  # the newest of them: later reads of this row wait for it
        self.epoch = 0  # bumped on preemption: results planned in an older epoch are discarded
        self.num_readonly_blocks = 0  # leading blocks whose writes completed (READ_ONLY)
        self.num_offered_blocks = 0  # leading blocks already offered to the prefix cache
        self.claims: list[int] = []  # prefix-block hashes this request computes for the cache
        self._block_hashes: list[int] | None = None
        self.num_preemptions = 0
        self.high_water = 0  # furthest position whose K/V ever completed (survives preemption)
        self.finish_reason: FinishReason | None = None  # set by Scheduler.finish only
        self.error: Exception | None = None  # why it failed on its own (e.g. its logits processor)
        self.stop_ids = (frozenset() if params.ignore_eos else eos_ids) | frozenset(params.stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, params.stop, params.skip_special_tokens)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None and index == 0 else None
        )

    @property
    def row(self) -> int:
        """The token-table row of an admitted request (the only kind a batch holds)."""
        assert self.table_row is not None, "the request holds no token-table row"
        return self.table_row

    @property
    def seq_len(self) -> int:
        """Committed length: prompt plus processed output tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def planned_len(self) -> int:
        """Length once every submitted iteration has drawn its token."""
        return self.seq_len + self.pending_samples

    @property
    def is_decode(self) -> bool:
        """Only the newest (maybe still in-flight) token lacks K/V: a one-token decode row."""
        return self.planned_len > len(self.prompt_ids) and self.num_computed == self.planned_len - 1

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks: entry i names the prefix ending with block i."""
        if self._block_hashes is None:
            self._block_hashes = prefix_hashes(
                self.prompt_ids, block_size, len(self.prompt_ids) // block_size
            )
        return self._block_hashes

    def cacheable_blocks(self, block_size: int) -> int:
        """Leading blocks a prefix-cache hit may cover: the last token is always recomputed (a query
        row must remain), and so is every position whose logits score a requested prompt logprob."""
        limit = self.planned_len - 1
        if self.prompt_logprobs is not None:
            limit = min(limit, self.params.prompt_logprobs_start - 1)
        return max(0, limit) // block_size

    def needs_prompt_logprob(self, target: int) -> bool:
        """Whether the prompt token at index `target` still needs its logprob (computed at target-1)."""
        return (
            self.prompt_logprobs is not None
            and self.params.prompt_logprobs_start <= target < len(self.prompt_ids)
            and self.prompt_logprobs[target] is None
        )

    def append_token(self, token: int, max_model_len: int) -> FinishReason | None:
        """Commit one sampled token; returns why the request is finished by it, or None."""
        self.token_times.append(time.perf_counter())
        self.output_ids.append(token)
        stopped_by_text = self.detok.append(self.output_ids)
        if token in self.stop_ids or stopped_by_text:
            return "stop"
        if len(self.output_ids) >= self.params.max_tokens or self.seq_len > max_model_len:
            return "length"
        return None

    def delta(self, new_ids: list[int]) -> StreamDelta:
        """The tokens just committed (the newest `new_ids` of output_ids) and the text they release."""
        finished = self.finish_reason is not None
        n = len(self.output_ids)
        lps = self.logprobs[n - len(new_ids) : n] if self.logprobs is not None else None
        text = self.detok.take_delta(finished)
        return StreamDelta(self.request_id, new_ids, text, finished, self.finish_reason, lps, self.index)

    def output(self) -> RequestOutput:
        assert self.finish_reason is not None
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.detok.text,
            finish_reason=self.finish_reason,
            seed=self.seed,
            timings=RequestTimings(
                self.arrival,
                self.token_times[0] if self.token_times else None,
                time.perf_counter(),
                self.scheduled_time,
                tuple(self.token_times),
            ),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_preemptions=self.num_preemptions,
            index=self.index,
        )
