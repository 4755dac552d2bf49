"""The public Engine: callers submit from any thread; one scheduler thread owns all request state (S7)."""

from __future__ import annotations

import atexit
import copy
import itertools
import logging
import numbers
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import (
    EmptyPromptError,
    EngineDeadError,
    EngineStalledError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    QueueFullError,
    ReentrantCallError,
)
from minisgl_backend.executor import make_executor
from minisgl_backend.executor.inputs import build_inputs
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.executor.tracker import make_tracker
from minisgl_backend.kvcache.block_pool import BlockPool, InvariantError
from minisgl_backend.kvcache.reclaim import RowPool
from minisgl_backend.kvcache.storage import KVCache, kv_bytes_per_block
from minisgl_backend.metrics import DEBUG_LOG, Metrics, Tracer, install_logging
from minisgl_backend.model import batch_invariant
from minisgl_backend.model.loader import DTYPES, load_model
from minisgl_backend.scheduler.request import Request, RequestHandle
from minisgl_backend.scheduler.scheduler import Batch, Scheduler
from minisgl_backend.scheduler.watchdog import ProgressWatchdog
from minisgl_backend.types import RequestOutput, SamplingParams, StreamDelta
from minisgl_backend.validation import check_text

log = logging.getLogger("minisgl")

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


# Engines whose idle scheduler thread has a command coming: the command's sender may drop the
# Engine right after sending, and the thread must still find it alive to serve that command.
_PINNED: set[Engine] = set()


def _scheduler_main(ref: weakref.ref[Engine]) -> None:
    """The scheduler thread. It holds the Engine strongly only while there is work: when idle it
    waits for the next command through a weak reference, so an Engine dropped without close() is
    collected and its finaliser stops every thread (nothing can be pending then: idle means every
    request was delivered, and a command sent to an idle engine pins it until the thread wakes)."""
    while True:
        engine = ref()
        if engine is None:
            return
        _PINNED.discard(engine)
        inbox = engine._inbox
        if not engine._loop():  # False: stopped for good; True: idle
            return
        with engine._life_lock:  # pairs with _send: from here on a sender pins the engine
            try:
                engine._resumed.append(inbox.get_nowait())  # a command raced in: stay busy
                continue
            except queue.Empty:
                engine._idle = True
        del engine
        cmd = inbox.get()
        engine = ref()
        if engine is None:  # only the finaliser's stop arrives unpinned
            return
        engine._resumed.append(cmd)
        del engine


def _shutdown(
    inbox: queue.SimpleQueue, tracker: Any, thread: threading.Thread, executor: Any, metrics: Metrics
) -> None:
    """Stop an engine's threads (Engine.close, or the finaliser of an Engine dropped without it).
    Holds no reference to the Engine itself."""
    inbox.put(("stop",))
    tracker.wake()
    current = threading.current_thread()
    if thread is not current and thread.is_alive():
        thread.join()
    if current in executor.threads:  # collected on a worker thread: it cannot join itself
        threading.Thread(
            target=_close_workers, args=(executor, metrics), name="minisgl-closer", daemon=True
        ).start()
    else:
        _close_workers(executor, metrics)


def _close_workers(executor: Any, metrics: Metrics) -> None:
    executor.close()
    metrics.close()


def _weak_stats_line(method: Callable[..., str]) -> Callable[..., str]:
    ref = weakref.WeakMethod(method)  # the metrics thread must not keep the Engine alive

    def stats_line(*args: Any) -> str:
        fn = ref()
        return fn(*args) if fn is not None else ""

    return stats_line


def _as_params(params: ParamsLike) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise InvalidSamplingParamsError(f"expected SamplingParams or dict, got {type(params).__name__}")


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
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        install_logging()
        self._max_inflight = config.max_inflight if config.overlap else 1
        self._tracker = make_tracker(config.callback_impl, self._max_inflight)
        # Known once the model is loaded; the stats line (a metrics thread) may fire before that.
        self.num_blocks = 0
        self._metrics = Metrics(
            exact=config.metrics_exact,
            stats_line=_weak_stats_line(self._stats_line),
            stats_every_s=config.stats_interval_s,
        )
        self.tracer = Tracer(config.trace)
        try:
            self._executor = make_executor(config, self._tracker, self._metrics, self.tracer)
        except BaseException:
            self._metrics.close()
            raise
        try:
            # Heavy torch work runs on the compute thread, the only one with an OpenMP team (see executor).
            loaded = self._executor.run_on_compute(
                lambda: load_model(config.model, config.dtype, config.device)
            )
            if config.deterministic:
                self._executor.run_on_compute(lambda: batch_invariant.enable(loaded.model))
            spec = loaded.model.spec
            per_block = kv_bytes_per_block(
                spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim, DTYPES[config.dtype]
            )
            self.num_blocks = config.num_blocks or max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)
            kv = self._executor.run_on_compute(
                lambda: KVCache(
                    spec.num_layers,
                    self.num_blocks,
                    config.block_size,
                    spec.num_kv_heads,
                    spec.head_dim,
                    DTYPES[config.dtype],
                    config.device,
                )
            )
        except BaseException:
            self._executor.close()
            self._metrics.close()
            raise
        self.model_dir = loaded.model_dir
        self.tokenizer = loaded.tokenizer
        self.vocab_size = spec.vocab_size
        limits = [spec.max_position_embeddings, self.num_blocks * config.block_size]
        self.max_model_len = min(limits + ([config.max_model_len] if config.max_model_len else []))
        self._executor.attach(loaded.model, kv, TokenTable(config.max_num_seqs, self.max_model_len + 1))
        unsafe = config.debug_unsafe_reclaim
        self._pool = BlockPool(self.num_blocks, unsafe_immediate_reclaim=unsafe)
        self._rows = RowPool(config.max_num_seqs, immediate=unsafe)
        self._scheduler = Scheduler(config, self._pool, self._rows, self.max_model_len, metrics=self._metrics)
        self._inflight: dict[int, Batch] = {}  # submitted, not yet processed (scheduler thread only)
        # Far above the pipeline depth: a legitimate run of result-less iterations is a few deep.
        self._watchdog = ProgressWatchdog(config.stall_timeout_s, min_iterations=16 * self._max_inflight)
        self._drain_waiters: list[tuple[Future, bool]] = []  # (future, flush_cache)
        self._eos_ids = loaded.eos_token_ids
        # The scheduler thread detokenises with its own copy: callers may be encoding concurrently.
        self._detok_tokenizer = copy.deepcopy(self.tokenizer)
        self._encode_lock = threading.Lock()
        self._seed_lock = threading.Lock()
        self._seed_rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._dead: BaseException | None = None
        self._life_lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}  # scheduler thread only
        self._resumed: list[tuple] = []  # the command that woke an idle scheduler thread (_scheduler_main)
        self._idle = False  # the scheduler thread waits without holding the Engine (under _life_lock)
        # The thread holds only a weak reference (see _scheduler_main): dropping the Engine closes it.
        self._thread = threading.Thread(
            target=_scheduler_main, args=(weakref.ref(self),), name="minisgl-scheduler", daemon=True
        )
        # Blocking calls from these threads (a logits processor, a done-callback) would deadlock.
        self._own_threads = frozenset([self._thread, *self._executor.threads])
        self._finalizer = weakref.finalize(
            self, _shutdown, self._inbox, self._tracker, self._thread, self._executor, self._metrics
        )
        self._thread.start()
        _LIVE_ENGINES.add(self)

    # ------------------------------------------------------------------ public API
    def submit(
        self, prompt: Prompt, params: ParamsLike = None, request_id: str | None = None
    ) -> RequestHandle:
        """Queue one request; returns at once. Safe to call from many threads. With
        `max_waiting_requests` set, raises QueueFullError while that many requests wait for admission."""
        req = self._make_request(prompt, _as_params(params), request_id)
        if (
            self.config.max_waiting_requests is not None
            and self.num_waiting() >= self.config.max_waiting_requests
        ):
            raise QueueFullError(
                f"{self.config.max_waiting_requests} requests are already waiting "
                "(max_waiting_requests); retry later"
            )
        self._send("add", req)
        return req.handle

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: ParamsLike | Sequence[ParamsLike] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion (all submitted at once); outputs in input order."""
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
        reqs = [self._make_request(p, sp, None) for p, sp in zip(prompts, plist)]
        done: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        for r in reqs:
            r.handle.add_done_callback(done.put)
        for r in reqs:
            self._send("add", r)
        if use_tqdm and reqs:
            from tqdm.auto import tqdm

            with tqdm(total=len(reqs), desc="minisgl generate", unit="req") as bar:
                for _ in reqs:
                    done.get()
                    bar.update(1)
        return [r.handle.result() for r in reqs]

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
        return len(self._scheduler.waiting) + self._inbox.qsize()

    def abort(self, request_id: str) -> None:
        """Stop a request; its result arrives with finish_reason 'abort'. Unknown ids are ignored."""
        self._send("abort", request_id)

    def check_invariants(self) -> dict[str, int]:
        """Verify KV accounting on the scheduler thread. Returns block counts per state plus
        'running' and 'waiting'; raises InvariantError when anything is inconsistent."""
        self._not_reentrant("Engine.check_invariants()")
        return self._call(self._check_invariants)

    def drain(self, timeout: float | None = None, flush_cache: bool = False) -> dict[str, int]:
        """Wait until no request is queued or running and no iteration is in flight (so every fenced
        block and row has been reclaimed), then return `check_invariants()`. Blocks the prefix cache
        holds stay READ_ONLY (`cached` in the result) unless `flush_cache`, which evicts them all so
        that every block is FREE."""
        self._not_reentrant("Engine.drain()")
        fut: Future = Future()
        self._send("drain", fut, flush_cache)
        return fut.result(timeout)

    def metrics(self) -> dict[str, float]:
        """Counters (iterations, prefill/decode/generated tokens, requests_finished, forward_s,
        sample_s; prefix_queries, prefix_hits, prefix_query_tokens, prefix_hit_tokens,
        prefix_evicted_blocks, prefix_insert_s) and gauges (running, waiting, kv_used_blocks,
        prefix_cache_blocks), folded about once per second (exact at any moment with `metrics_exact`)."""
        return self._metrics.snapshot()

    @property
    def is_alive(self) -> bool:
        """Whether the engine can serve requests: not closed, and neither its scheduler thread nor an
        executor worker has failed (a failed worker is noticed here before the next request)."""
        return self._dead is None and self._thread.is_alive() and self._executor.error is None

    @property
    def dead(self) -> BaseException | None:
        """Why the engine stopped (an EngineDeadError, cause chained), or None while it runs."""
        return self._dead

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
    def _send(self, *cmd: Any) -> None:
        with self._life_lock:  # pairs with _fail_all: nothing is queued after the final drain
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead}") from self._dead
            if self._idle:  # keep the Engine alive until its thread has taken this command
                self._idle = False
                _PINNED.add(self)
            self._inbox.put(cmd)
        self._tracker.wake()  # the scheduler may be blocked waiting for completions

    def _not_reentrant(self, what: str) -> None:
        current = threading.current_thread()
        if current in self._own_threads:
            raise ReentrantCallError(
                f"{what} was called from the engine's own thread {current.name!r} (e.g. inside a logits "
                "processor or a result callback): it would wait for work that this thread must do, a "
                "deadlock. Call it from another thread."
            )

    def _call(self, fn: Callable[[], Any]) -> Any:
        fut: Future = Future()
        self._send("call", fn, fut)
        return fut.result()

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

    def _make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None) -> Request:
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
        handle = RequestHandle(rid)
        handle._engine_threads = self._own_threads
        return Request(rid, ids, params, seed, self._eos_ids, self._detok_tokenizer, handle)

    # ------------------------------------------------------------------ scheduler thread
    def _check_invariants(self) -> dict[str, int]:
        counts = self._pool.check_invariants()
        sched = self._scheduler
        holders = [r for r in list(sched.running) + list(sched.waiting) if r.row is not None]
        if len(holders) + self._rows.num_free + self._rows.num_pending() != self._rows.num_rows:
            raise InvariantError("token-table rows leaked or double-counted")
        if any(r.block_table for r in sched.waiting):
            raise InvariantError("a waiting request holds blocks")
        # Every reference is accounted for: running requests' block tables plus the prefix cache.
        refs = sched.cache_holders()
        for r in sched.running:
            for b in r.block_table:
                refs[b] = refs.get(b, 0) + 1
        for b, rc in enumerate(self._pool.refcount):
            if rc != refs.get(b, 0):
                raise InvariantError(
                    f"block {b} ({self._pool.state[b].name}) has refcount {rc} but {refs.get(b, 0)} holders"
                )
        cached = sched.cache.num_blocks if sched.cache is not None else 0
        return {
            **counts,
            "cached": cached,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "rows_free": self._rows.num_free,
            "inflight": len(self._inflight),
        }

    def _loop(self) -> bool:
        """Run until idle (True: _scheduler_main waits for the next command without holding the
        Engine, then calls this again) or stopped (False)."""
        sched, tracker, limit = self._scheduler, self._tracker, self._max_inflight
        done: list[int] = []
        try:
            while True:
                idle = not sched.has_work() and not self._inflight and not done
                if idle and not self._resumed:
                    return True
                cmds, self._resumed = self._resumed, []
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if cmd[0] != "stop":
                        self._handle(cmd)
                if any(cmd[0] == "stop" for cmd in cmds):
                    self._fail_all(EngineDeadError("engine closed"))
                    return False
                done += tracker.drain()
                if self._executor.error is not None:
                    raise self._executor.error
                if self.config.overlap:
                    # Feed the compute worker first, then do the bookkeeping while it runs.
                    self._fill_pipeline(limit)
                    self._process(done)
                    self._fill_pipeline(limit)  # processing may have freed blocks for admissions
                else:  # serial: plan -> run -> sample -> process, one iteration at a time
                    self._process(done)
                    self._fill_pipeline(1)
                # The idle point: the device has its work. Deferred (async) prefix-cache inserts go
                # here, off the completion -> plan path; what they unblock is planned at once.
                if sched.flush_deferred_inserts():
                    self._fill_pipeline(limit)
                try:
                    self._watchdog.observe(sched.progress, len(done), busy=sched.has_work())
                except EngineStalledError as e:
                    self._metrics.add("stalls")
                    log.error(
                        "%s; running=%d waiting=%d free_blocks=%d pending_blocks=%d",
                        e,
                        len(sched.running),
                        len(sched.waiting),
                        self._pool.num_free,
                        self._pool.num_pending,
                    )
                    raise
                done = []
                if self._drain_waiters and not sched.has_work() and not self._inflight:
                    self._resolve_drain_waiters()
                if self._inflight:
                    done = tracker.wait(1.0)  # GIL released; woken by a completion or a new command
                elif sched.has_work() and not cmds and not sched.finished:
                    raise InvariantError("scheduler has work but can plan nothing (deadlock)")
        except BaseException as e:  # noqa: BLE001 - every failure must reach the callers, not hang them
            log.exception("scheduler thread failed")
            self._fail_all(EngineDeadError(f"scheduler thread failed: {e!r}"), cause=e)
            return False

    def _fill_pipeline(self, limit: int) -> None:
        """Plan and submit iterations while fewer than `limit` are in flight (S13 backpressure)."""
        while self._tracker.inflight < limit:
            t0 = time.perf_counter()
            batch = self._scheduler.schedule()
            if batch is None:
                break
            self._inflight[batch.iteration] = batch
            self._executor.submit(build_inputs(batch, self.config.block_size))
            self.tracer.span("scheduler", f"plan {batch.iteration}", t0, time.perf_counter())
            prefill = sum(r.length for r in batch.prefill)
            self._metrics.add("iterations")
            self._metrics.add("prefill_tokens", prefill)
            self._metrics.add("decode_tokens", len(batch.decode))
            if DEBUG_LOG:
                log.debug(
                    "iteration %d: %d decode rows, %d prefill tokens, waits for %d",
                    batch.iteration,
                    len(batch.decode),
                    prefill,
                    batch.depends_on,
                )

    def _process(self, done: list[int]) -> None:
        """Apply completed iterations in order and deliver what they produced."""
        for it in done:
            t0 = time.perf_counter()
            batch = self._inflight.pop(it)
            new_tokens: dict[int, list[int]] = {}
            updates = self._scheduler.complete(batch, self._executor.take_result(it))
            self._metrics.add("generated_tokens", len(updates))
            for req, ids in updates:
                new_tokens[id(req)] = ids
                if req.finish_reason is None:
                    req.handle._post_delta(req.delta(ids))
            self._deliver_finished(new_tokens)
            self.tracer.span("scheduler", f"process {it}", t0, time.perf_counter())
        self._deliver_finished({})  # aborts
        sched = self._scheduler
        self._metrics.set("running", len(sched.running))
        self._metrics.set("waiting", len(sched.waiting))
        self._metrics.set("kv_used_blocks", self.num_blocks - self._pool.num_free)
        if sched.cache is not None:
            self._metrics.set("prefix_cache_blocks", sched.cache.num_blocks)

    def _stats_line(self, cur: dict[str, float], prev: dict[str, float], dt: float) -> str:
        def rate(key: str) -> float:
            return (cur.get(key, 0.0) - prev.get(key, 0.0)) / dt

        return (
            f"running={cur.get('running', 0):.0f} waiting={cur.get('waiting', 0):.0f} "
            f"kv={cur.get('kv_used_blocks', 0) / max(1, self.num_blocks):.0%} "
            f"gen={rate('generated_tokens'):.1f} tok/s prefill={rate('prefill_tokens'):.1f} tok/s "
            f"iterations={rate('iterations'):.1f}/s"
            + (
                f" prefix_hit={rate('prefix_hit_tokens') / max(rate('prefix_query_tokens'), 1e-9):.0%}"
                if self.config.prefix_cache != "off"
                else ""
            )
        )

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            req: Request = cmd[1]
            if req.request_id in self._handles:
                req.handle._post_error(InvalidRequestError(f"duplicate request_id {req.request_id!r}"))
                return
            self._handles[req.request_id] = req.handle
            self._scheduler.add(req)
        elif kind == "abort":
            self._scheduler.abort(cmd[1])
        elif kind == "drain":
            self._drain_waiters.append(cmd[1:])
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                fut.set_exception(e)

    def _resolve_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        if any(flush for _, flush in waiters):
            self._scheduler.flush_cache()  # nothing is in flight, so evicted blocks are FREE at once
        for fut, _ in waiters:
            try:
                fut.set_result(self._check_invariants())
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                fut.set_exception(e)

    def _deliver_finished(self, new_tokens: dict[int, list[int]]) -> None:
        for req in self._scheduler.take_finished():
            self._handles.pop(req.request_id, None)
            self._metrics.add("requests_finished")
            if req.error is not None:
                req.handle._post_error(req.error)
                continue
            req.handle._post_delta(req.delta(new_tokens.get(id(req), [])))
            req.handle._post_result(req.output())

    def _fail_all(self, err: EngineDeadError, cause: BaseException | None = None) -> None:
        if cause is not None:
            err.__cause__ = cause
        with self._life_lock:
            self._dead = err
        for handle in self._handles.values():
            handle._post_error(err)
        self._handles.clear()
        # Requests still in the inbox (raced with the failure) are failed too.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                cmd[1].handle._post_error(err)
            elif cmd[0] == "call":
                cmd[2].set_exception(err)
            elif cmd[0] == "drain":
                cmd[1].set_exception(err)
        for fut, _ in self._drain_waiters:
            fut.set_exception(err)
        self._drain_waiters.clear()
