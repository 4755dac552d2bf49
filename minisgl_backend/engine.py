"""The public Engine: a façade over the scheduler loop (scheduler/loop.py).

It builds the pieces (executor, model, KV cache, pools, scheduler, loop), validates every request
on the caller's thread (so a bad request fails its caller, never the engine) and hands the loop
typed commands. Callers may submit from any thread; the one scheduler thread owns all request
state (S7).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import itertools
import logging
import numbers
import queue
import random
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    QueueFullError,
    ReentrantCallError,
)
from minisgl_backend.executor import make_executor
from minisgl_backend.executor.base import DualWorkerExecutor
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.executor.tracker import make_tracker
from minisgl_backend.handle import RequestHandle
from minisgl_backend.kvcache.block_pool import BlockPool
from minisgl_backend.kvcache.reclaim import RowPool
from minisgl_backend.kvcache.storage import KVCache, kv_bytes_per_block
from minisgl_backend.metrics import Metrics, Tracer, install_logging
from minisgl_backend.model import cpu_threads
from minisgl_backend.model.loader import DTYPES, LoadedModel, load_model, prepare
from minisgl_backend.sampling.sampler import sample_key
from minisgl_backend.scheduler.loop import Abort, Add, Drain, SchedulerLoop, StatsLine
from minisgl_backend.scheduler.request import Request, SampleGroup
from minisgl_backend.scheduler.scheduler import Scheduler
from minisgl_backend.types import RequestOutput, SamplingParams, StreamDelta
from minisgl_backend.validation import check_text

log = logging.getLogger("minisgl")


def _own_processors(params: SamplingParams) -> SamplingParams:
    """`params` for one sequence: each logits processor that has a `fork()` (a stateful one, such as a
    grammar's parser) replaced by a fork of it, so the n samples of a request and the prompts that
    share one SamplingParams never advance each other's state."""
    procs = params.logits_processors
    if not any(callable(getattr(p, "fork", None)) for p in procs):
        return params
    forked = tuple(p.fork() if callable(getattr(p, "fork", None)) else p for p in procs)
    return dataclasses.replace(params, logits_processors=forked)


Prompt = str | Sequence[int]
ParamsLike = SamplingParams | dict | None


_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    # Engine threads are daemons blocked in native waits with the GIL released. Left running into
    # interpreter finalisation, such a thread is unwound by pthread_exit through a noexcept pybind11
    # destructor -> std::terminate ("terminate called without an active exception"). Stop them first.
    for engine in list(_LIVE_ENGINES):
        engine.close()


def _as_params(params: ParamsLike) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise InvalidSamplingParamsError(f"expected SamplingParams or dict, got {type(params).__name__}")


def _load(config: EngineConfig, executor: DualWorkerExecutor) -> tuple[LoadedModel, KVCache]:
    """Load the model and size + allocate the KV cache, on the compute thread: heavy torch work runs
    there, the only thread with an OpenMP team (see executor/base.py)."""
    loaded = executor.run_on_compute(lambda: load_model(config.model, config.dtype, config.device))
    executor.run_on_compute(lambda: prepare(loaded.model, config.weight_dtype, config.deterministic))
    spec, dtype = loaded.model.spec, DTYPES[config.dtype]
    per_block = kv_bytes_per_block(
        spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim, dtype
    )
    num_blocks = config.num_blocks or max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)
    shape = (spec.num_layers, num_blocks, config.block_size, spec.num_kv_heads, spec.head_dim)
    kv = executor.run_on_compute(lambda: KVCache(*shape, dtype, config.device))
    return loaded, kv


class Engine:
    """Continuous-batching LLM engine over a paged KV cache.

    >>> with Engine(EngineConfig(dtype="bfloat16")) as eng:
    ...     print(eng.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].text)
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = config or EngineConfig()
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        install_logging()
        if torch.device(config.device).type == "cpu":
            threads = cpu_threads.plan(config.num_threads, config.dtype)
            if cpu_threads.apply(threads):
                log.info("CPU threads: %s", threads.describe())
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        tracker = make_tracker(config.callback_impl, config.max_inflight if config.overlap else 1)
        # The metrics thread may log a stats line before the KV cache is sized (num_blocks 0).
        stats = StatsLine(prefix_cache=config.prefix_cache != "off")
        metrics = Metrics(exact=config.metrics_exact, stats_line=stats, stats_every_s=config.stats_interval_s)
        self.tracer = Tracer(config.trace)
        try:
            executor = make_executor(config, tracker, metrics, self.tracer)
        except BaseException:
            metrics.close()
            raise
        try:
            loaded, kv = _load(config, executor)
        except BaseException:
            executor.close()
            metrics.close()
            raise
        spec = loaded.model.spec
        self.num_blocks = stats.num_blocks = kv.num_blocks
        self.model_dir = loaded.model_dir
        self.tokenizer = loaded.tokenizer
        self.vocab_size = spec.vocab_size
        self.model_spec = spec  # the model's shape, as the benchmarks count its work
        self.decode_weight_bytes = loaded.model.decode_weight_bytes()  # what minisgl bench reports
        limits = [spec.max_position_embeddings, self.num_blocks * config.block_size]
        self.max_model_len = min(limits + ([config.max_model_len] if config.max_model_len else []))
        executor.attach(loaded.model, kv, TokenTable(config.max_num_seqs, self.max_model_len + 1))
        unsafe = config.debug_unsafe_reclaim
        pool = BlockPool(self.num_blocks, unsafe_immediate_reclaim=unsafe)
        rows = RowPool(config.max_num_seqs, immediate=unsafe)
        scheduler = Scheduler(config, pool, rows, self.max_model_len, metrics=metrics)
        self._loop = SchedulerLoop(config, scheduler, executor, tracker, metrics, self.tracer)
        self._executor, self._metrics = executor, metrics
        self._eos_ids = loaded.eos_token_ids
        # The scheduler thread detokenises with its own copy: callers may be encoding concurrently.
        self._detok_tokenizer = copy.deepcopy(self.tokenizer)
        self._encode_lock = threading.Lock()
        self._seed_lock = threading.Lock()
        self._seed_rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self._ids = itertools.count()
        # Blocking calls from these threads (a logits processor, a done-callback) would deadlock.
        self._own_threads = frozenset([self._loop.thread, *executor.threads])
        # The loop holds the Engine only while work is pending (SchedulerLoop._keepalive), so an
        # Engine dropped without close() is collected once idle, and this stops its threads.
        self._finalizer = weakref.finalize(self, self._loop.shutdown)
        self._loop.thread.start()
        _LIVE_ENGINES.add(self)

    # ------------------------------------------------------------------ public API
    def submit(
        self,
        prompt: Prompt,
        params: ParamsLike = None,
        request_id: str | None = None,
        owner: str | None = None,
    ) -> RequestHandle:
        """Queue one request; returns at once. Safe to call from many threads. With
        `max_waiting_requests` set, raises QueueFullError while that many requests wait for admission.
        `owner`: who it is for; with `fair_admission` (the default) waiting requests of different
        owners are admitted in turn (default: the request is its own owner)."""
        reqs = self._make_requests(prompt, _as_params(params), request_id, owner)
        if (
            self.config.max_waiting_requests is not None
            and self.num_waiting() >= self.config.max_waiting_requests
        ):
            raise QueueFullError(
                f"{self.config.max_waiting_requests} requests are already waiting "
                "(max_waiting_requests); retry later"
            )
        self._loop.send(Add(reqs), self)
        return reqs[0].handle

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: ParamsLike | Sequence[ParamsLike] = None,
        use_tqdm: bool = True,
        desc: str = "minisgl generate",
    ) -> list[RequestOutput]:
        """Run prompts to completion (all submitted at once); outputs in input order, one per prompt
        (a request with n > 1 gives sample 0, with all n in `RequestOutput.samples`). `desc` labels
        the progress bar (`use_tqdm`)."""
        self._not_reentrant("Engine.generate()")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidSamplingParamsError(f"{len(params)} sampling params for {len(prompts)} prompts")
            plist = [_as_params(p) for p in params]
        else:
            plist = [_as_params(params)] * len(prompts)
        # Validate everything before queueing anything: a bad prompt fails the call, not half of it.
        reqs = [self._make_requests(p, sp, None) for p, sp in zip(prompts, plist)]
        handles = [r[0].handle for r in reqs]
        done: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        for h in handles:
            h.add_done_callback(done.put)
        for r in reqs:
            self._loop.send(Add(r), self)
        if use_tqdm and handles:
            from tqdm.auto import tqdm

            with tqdm(total=len(handles), desc=desc, unit="req") as bar:
                for _ in handles:
                    done.get()
                    bar.update(1)
        return [h.result() for h in handles]

    def stream(self, prompt: Prompt, params: ParamsLike = None) -> Iterator[StreamDelta]:
        """Yield deltas as tokens are produced; closing the iterator early aborts the request."""
        self._not_reentrant("Engine.stream()")
        handle = self.submit(prompt, params)
        try:
            yield from handle
        finally:
            if not handle.done():
                self.abort(handle.request_id)

    def num_waiting(self) -> int:
        """Requests submitted but not admitted yet: the scheduler's waiting queue plus commands not
        yet read by the scheduler thread (an upper bound; read without a lock, from any thread)."""
        return self._loop.num_waiting()

    def abort(self, request_id: str) -> None:
        """Stop a request; its result arrives with finish_reason 'abort'. Unknown ids are ignored."""
        self._loop.send(Abort(request_id), self)

    def check_invariants(self) -> dict[str, int]:
        """Verify KV accounting on the scheduler thread. Returns block counts per state plus
        'running' and 'waiting'; raises InvariantError when anything is inconsistent."""
        self._not_reentrant("Engine.check_invariants()")
        return self._loop.call(self._loop.check_invariants, self)

    def drain(self, timeout: float | None = None, flush_cache: bool = False) -> dict[str, int]:
        """Wait until no request is queued or running and no iteration is in flight (so every fenced
        block and row has been reclaimed), then return `check_invariants()`. Blocks the prefix cache
        holds stay READ_ONLY (`cached` in the result) unless `flush_cache`, which evicts them all so
        that every block is FREE."""
        self._not_reentrant("Engine.drain()")
        fut: Future = Future()
        self._loop.send(Drain(fut, flush_cache), self)
        return fut.result(timeout)

    def metrics(self) -> dict[str, float]:
        """Counters (iterations, prefill/decode/generated tokens, requests_finished, stalls,
        forward_s, sample_s; prefix_queries, prefix_hits, prefix_query_tokens, prefix_hit_tokens,
        prefix_inserted_blocks, prefix_evicted_blocks, prefix_insert_s) and gauges (running,
        waiting, kv_used_blocks, prefix_cache_blocks), folded about once per second (exact at any
        moment with `metrics_exact`). docs/index.md ("How it works") says what each counts."""
        return self._metrics.snapshot()

    @property
    def is_alive(self) -> bool:
        """Whether the engine can serve requests: not closed, and neither its scheduler thread nor an
        executor worker has failed (a failed worker is noticed here before the next request)."""
        return self._loop.dead is None and self._loop.thread.is_alive() and self._executor.error is None

    @property
    def dead(self) -> BaseException | None:
        """Why the engine stopped (an EngineDeadError, cause chained), or None while it runs."""
        return self._loop.dead

    def close(self) -> None:
        """Stop the engine: waiting callers get EngineDeadError; idempotent. An Engine dropped
        without close() is closed by its finaliser once collected."""
        self._not_reentrant("Engine.close()")
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ caller-thread helpers
    def _not_reentrant(self, what: str) -> None:
        current = threading.current_thread()
        if current in self._own_threads:
            raise ReentrantCallError(
                f"{what} was called from the engine's own thread {current.name!r} (e.g. inside a logits "
                "processor or a result callback): it would wait for work that this thread must do, a "
                "deadlock. Call it from another thread."
            )

    def _tokenize(self, prompt: Prompt) -> list[int]:
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

    def _make_requests(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None, owner: str | None = None
    ) -> tuple[Request, ...]:
        """The request's params.n samples (one Request each, sample i keyed by sample_key(seed, i)),
        with one handle and one SampleGroup between them."""
        ids = self._tokenize(prompt)
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
        cap = self.config.max_logprobs
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
        handle._engine_threads = self._own_threads
        group = SampleGroup(params.n)
        return tuple(
            Request(
                rid,
                ids,
                _own_processors(params),
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
