"""Scheduler-side state of one request (a batch "slot", S7): owned by the scheduler thread only."""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

from minisgl_backend.errors import ReentrantCallError
from minisgl_backend.kvcache.prefix_cache import prefix_hashes
from minisgl_backend.sampling.detokenizer import IncrementalDetokenizer
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


class RequestHandle:
    """The caller's side of a request: `result()` and iteration over StreamDelta.

    The scheduler thread only posts into it (a queue put and a Future result); it never reads it.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._future: Future[RequestOutput] = Future()
        self._deltas: queue.SimpleQueue[StreamDelta | BaseException] = queue.SimpleQueue()
        self._engine_threads: frozenset[threading.Thread] = frozenset()  # set by the engine
        self._consumed = False  # the final delta (or the error) was taken by an iterator

    def _not_reentrant(self, what: str) -> None:
        current = threading.current_thread()
        if current in self._engine_threads and not self._future.done():
            raise ReentrantCallError(
                f"RequestHandle.{what} for {self.request_id!r} was called from the engine's own thread "
                f"{current.name!r} (e.g. inside a logits processor or a result callback): the request "
                "cannot finish while that thread waits for it, a deadlock. Call it from another thread."
            )

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; raises TimeoutError, EngineDeadError if the engine died,
        RequestFailedError if sampling it failed (InvalidRequestError for a duplicate request_id),
        ReentrantCallError when called unfinished from one of the engine's own threads."""
        self._not_reentrant("result()")
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __iter__(self) -> Iterator[StreamDelta]:
        """The deltas, once: iterating again after the final delta (or the error) has been taken
        returns at once (re-raising that error) instead of blocking forever."""
        while True:
            if self._consumed:
                if self._future.done() and self._future.exception() is not None:
                    raise self._future.exception()  # type: ignore[misc]
                return
            if self._deltas.empty():
                self._not_reentrant("__iter__()")
            item = self._deltas.get()
            if isinstance(item, BaseException):
                self._consumed = True
                raise item
            if item.finished:
                self._consumed = True
            yield item
            if item.finished:
                return

    # --- posted by the scheduler thread ---
    def _post_delta(self, delta: StreamDelta) -> None:
        self._deltas.put(delta)

    def _post_result(self, out: RequestOutput) -> None:
        self._future.set_result(out)

    def _post_error(self, err: Exception) -> None:
        if not self._future.done():
            self._deltas.put(err)
            self._future.set_exception(err)


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
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        self.handle = handle
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None  # first admission; a re-admission keeps it
        self.status = RequestStatus.WAITING
        self.output_ids: list[int] = []  # committed: results the scheduler has processed
        self.block_table: list[int] = []
        self.row: int | None = None  # token-table row, held from admission to finish
        # Planning runs ahead of results (overlap): these count work submitted but maybe not done.
        self.num_computed = 0  # positions whose K/V computation has been submitted
        self.pending_samples = 0  # submitted iterations that will draw a token for this request
        self.last_sample_iteration = 0  # the newest of them: later reads of this row wait for it (S6)
        self.epoch = 0  # bumped on preemption: results planned in an older epoch are discarded
        self.num_readonly_blocks = 0  # leading blocks whose writes completed (READ_ONLY)
        self.num_cached_blocks = 0  # leading blocks already offered to the prefix cache
        self.claims: list[int] = []  # prefix-block hashes this request computes for the cache
        self._block_hashes: list[int] | None = None
        self.num_preemptions = 0
        self.high_water = 0  # furthest position whose K/V ever completed (survives preemption)
        self.finish_reason: FinishReason | None = None
        self.error: Exception | None = None  # set when the request failed on its own (logits processor)
        self.stop_ids = (frozenset() if params.ignore_eos else eos_ids) | frozenset(params.stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, params.stop, params.skip_special_tokens)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None
        )

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

    def append_token(self, token: int, max_model_len: int) -> None:
        """Record one sampled token and decide whether the request is finished."""
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_ids.append(token)
        stopped_by_text = self.detok.append(self.output_ids)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif stopped_by_text:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens or self.seq_len > max_model_len:
            self.finish_reason = "length"

    def delta(self, new_ids: list[int]) -> StreamDelta:
        finished = self.finish_reason is not None
        return StreamDelta(
            self.request_id, new_ids, self.detok.take_delta(finished), finished, self.finish_reason
        )

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
                self.arrival, self.first_token_time, time.perf_counter(), self.scheduled_time
            ),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_preemptions=self.num_preemptions,
        )
