"""The public Engine: a façade over the scheduler loop (scheduler/loop.py).

It builds the pieces (executor, model, KV cache, pools, scheduler, loop), validates every request
on the caller's thread (so a bad request fails its caller, never the engine) and hands the loop
typed commands. Callers may submit from any thread; the one scheduler thread owns all request
state, so no request is freed while another thread still works on it.
"""

from __future__ import annotations

import atexit
import copy
import logging
import queue
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import (
    QueueFullError,
    ReentrantCallError,
)
from minisgl_backend.executor import make_executor
from minisgl_backend.executor.base import DualWorkerExecutor
from minisgl_backend.executor.token_table import RowPool, TokenTable
from minisgl_backend.executor.tracker import make_tracker
from minisgl_backend.handle import RequestHandle
from minisgl_backend.kvcache.block_pool import BlockPool
from minisgl_backend.kvcache.storage import KVCache, kv_blocks_from_device_memory, kv_bytes_per_block
from minisgl_backend.metrics import Metrics, Tracer, install_logging
from minisgl_backend.model import cpu_threads
from minisgl_backend.model.loader import DTYPES, LoadedModel, load_model, prepare
from minisgl_backend.scheduler.intake import (
    ParamsLike,
    Prompt,
    RequestIntake,
    as_params,
    as_params_list,
    as_prompt_list,
)
from minisgl_backend.scheduler.loop import Abort, Add, Drain, SchedulerLoop, StatsLine
from minisgl_backend.scheduler.scheduler import Scheduler
from minisgl_backend.types import RequestOutput, StreamDelta

log = logging.getLogger("minisgl")


_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


class _SwitchIntervals:
    """Python's GIL switch interval (process-wide) while engines that ask for one run: the shortest
    asked for, and the process's own value back once the last of them closes. A thread that wants
    the GIL waits up to this long for a busy thread to hand it over, and the engine's three threads
    hand work to each other every iteration."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, float] = {}
        self._base = 0.0

    def hold(self, key: int, seconds: float | None) -> None:
        if seconds is None:
            return
        with self._lock:
            if not self._held:
                self._base = sys.getswitchinterval()
            self._held[key] = seconds
            sys.setswitchinterval(min(self._held.values()))

    def release(self, key: int) -> None:
        with self._lock:
            if self._held.pop(key, None) is None:
                return
            sys.setswitchinterval(min(self._held.values()) if self._held else self._base)


_SWITCH_INTERVALS = _SwitchIntervals()


def _shutdown(loop: SchedulerLoop, key: int) -> None:
    loop.shutdown()
    _SWITCH_INTERVALS.release(key)


@atexit.register
def _close_live_engines() -> None:
    # Engine threads are daemons blocked in native waits with the GIL released. Left running into
    # interpreter finalisation, such a thread is unwound by pthread_exit through a noexcept pybind11
    # destructor -> std::terminate ("terminate called without an active exception"). Stop them first.
    for engine in list(_LIVE_ENGINES):
        engine.close()


def _device_free_bytes(dev: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device, counting as free what torch's allocator holds cached but
    unused in this process (memory that an earlier engine or model gave back keeps the device's own
    count low until the cache is emptied)."""
    free, total = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev), total


def _load(config: EngineConfig, executor: DualWorkerExecutor) -> tuple[LoadedModel, KVCache]:
    """Load the model and size + allocate the KV cache, on the compute thread: heavy torch work runs
    there, the only thread with an OpenMP team (see executor/base.py)."""
    # int8 weights are quantized from the dense ones, then packed (prepare): no packing as they load.
    pack = config.weight_dtype != "int8"
    loaded = executor.run_on_compute(lambda: load_model(config.model, config.dtype, config.device, pack))
    executor.run_on_compute(lambda: prepare(loaded.model, config.weight_dtype, config.deterministic))
    spec, dtype = loaded.model.spec, DTYPES[loaded.dtype]
    per_block = kv_bytes_per_block(
        spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim, dtype
    )
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif config.kv_cache_memory_gb is not None:
        num_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)
    else:  # CUDA (a CPU config always has kv_cache_memory_gb): what the weights left of the device
        dev = torch.device(config.device)
        free, total = executor.run_on_compute(lambda: _device_free_bytes(dev))
        num_blocks = kv_blocks_from_device_memory(free, total, config.gpu_memory_utilization, per_block)
    pool_blocks = num_blocks + executor.reserved_kv_blocks  # the reserved ones last, never handed out
    shape = (spec.num_layers, pool_blocks, config.block_size, spec.num_kv_heads, spec.head_dim)
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
            threads = cpu_threads.plan(config.num_threads, config.dtype, config.deterministic)
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
        self.num_blocks = stats.num_blocks = kv.num_blocks - executor.reserved_kv_blocks
        self.model_dir = loaded.model_dir
        self.tokenizer = loaded.tokenizer
        self.vocab_size = spec.vocab_size
        self.model_spec = spec  # the model's shape, as the benchmarks count its work
        self.decode_weight_bytes = loaded.model.decode_weight_bytes()  # what minisgl bench reports
        # What the model needs (its parameters in the model dtype) and what it holds once prepared
        # (packs in place of weights): `minisgl bench --scenario memory` sets them beside the RSS.
        self.weight_bytes = loaded.model.weight_bytes()
        self.held_weight_bytes = loaded.model.held_bytes()
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
        limits = [spec.max_position_embeddings, self.num_blocks * config.block_size]
        self.max_model_len = min(limits + ([config.max_model_len] if config.max_model_len else []))
        executor.attach(loaded.model, kv, TokenTable(config.max_num_seqs, self.max_model_len + 1))
        unsafe = config.debug_unsafe_reclaim
        pool = BlockPool(self.num_blocks, unsafe_immediate_reclaim=unsafe)
        rows = RowPool(config.max_num_seqs, immediate=unsafe)
        scheduler = Scheduler(config, pool, rows, self.max_model_len, metrics=metrics)
        self._loop = SchedulerLoop(config, scheduler, executor, tracker, metrics, self.tracer)
        self._executor, self._metrics = executor, metrics
        # Blocking calls from these threads (a logits processor, a done-callback) would deadlock.
        self._own_threads = frozenset([self._loop.thread, *executor.threads])
        # The scheduler thread detokenises with its own copy: callers may be encoding concurrently.
        detok = copy.deepcopy(self.tokenizer)
        self._intake = RequestIntake(
            config,
            self.tokenizer,
            detok,
            self.vocab_size,
            self.max_model_len,
            loaded.eos_token_ids,
            self._own_threads,
        )
        # The loop holds the Engine only while work is pending (SchedulerLoop._keepalive), so an
        # Engine dropped without close() is collected once idle, and this stops its threads.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, id(self))
        ms = config.switch_interval_ms
        _SWITCH_INTERVALS.hold(id(self), None if ms is None else ms / 1000)
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
        `owner`: whose share of admission the request takes under `scheduling_policy: fair` (the
        server passes one per HTTP request, for all its prompts); default: the request's own id."""
        reqs = self._intake.make_requests(prompt, as_params(params), request_id, owner)
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
        plist = as_prompt_list(prompts)
        # Validate everything before queueing anything: a bad prompt fails the call, not half of it.
        reqs = [
            self._intake.make_requests(p, sp, None)
            for p, sp in zip(plist, as_params_list(params, len(plist)))
        ]
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
