"""The scheduler thread's loop: the one owner of request state.

Slot state (a request's blocks, rows and outputs) changes only here; the executor's workers only
report completions. So nothing frees a slot while another thread still reads or samples from it.

Callers never touch a Request, the Scheduler or the pools: the Engine hands them typed commands
through `send` (any thread) and this loop, alone on its thread, applies them. One pass of the loop:

    commands -> completions (tracker) -> plan + submit (fill the pipeline)
             -> apply results + deliver -> deferred prefix inserts -> watchdog -> wait

With overlap the pipeline is filled before the bookkeeping of completed iterations, so the compute
worker has its next iteration while this thread processes the last one. Delivery posts into each
request's RequestHandle (a queue put, a Future result): the loop never reads a handle back.

Lifetime: the thread holds the loop, never the Engine. While work is pending the loop keeps the
Engine alive (`_keepalive`, set by the sender of the command that woke an idle loop), so an Engine
dropped right after `submit` still serves that request; once idle it lets go, so an Engine dropped
without `close()` is collected and its finaliser stops the threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import EngineDeadError, EngineStalledError, InvalidRequestError, InvariantError
from minisgl_backend.executor.base import DualWorkerExecutor
from minisgl_backend.executor.tracker import InflightTracker
from minisgl_backend.handle import RequestHandle
from minisgl_backend.metrics import DEBUG_LOG, Metrics, Tracer
from minisgl_backend.scheduler.inputs import build_inputs
from minisgl_backend.scheduler.request import Request
from minisgl_backend.scheduler.scheduler import Batch, Scheduler
from minisgl_backend.scheduler.watchdog import ProgressWatchdog

log = logging.getLogger("minisgl")


# ---- commands: what caller threads ask of the scheduler thread ----
@dataclass(frozen=True)
class Add:
    """One request: its samples (one Request each, SamplingParams.n of them), one handle."""

    reqs: tuple[Request, ...]


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Drain:
    """Resolve `future` with the invariant counts once nothing is queued, running or in flight."""

    future: Future
    flush_cache: bool


@dataclass(frozen=True)
class Call:
    """Run `fn` on the scheduler thread (e.g. an invariant check) and resolve `future` with it."""

    fn: Callable[[], Any]
    future: Future


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Abort | Drain | Call | Stop


class StatsLine:
    """The periodic one-line summary the metrics thread logs (`stats_interval_s`)."""

    def __init__(self, prefix_cache: bool) -> None:
        self.prefix_cache = prefix_cache
        self.num_blocks = 0  # known once the KV cache is sized

    def __call__(self, cur: dict[str, float], prev: dict[str, float], dt: float) -> str | None:
        """The line, or None when the engine was idle all along (a server waiting for clients would
        otherwise repeat the same line of zeros forever)."""

        def rate(key: str) -> float:
            return (cur.get(key, 0.0) - prev.get(key, 0.0)) / dt

        if not (cur.get("running") or cur.get("waiting") or rate("iterations")):
            return None
        # Blocks that only the prefix cache holds are free to evict: not counted as in use, as in
        # the server's kv_cache_usage_perc.
        blocks = max(1, self.num_blocks)
        cached = cur.get("prefix_cache_idle_blocks", 0.0)
        held = max(0.0, cur.get("kv_used_blocks", 0.0) - cached)
        line = (
            f"running={cur.get('running', 0):.0f} waiting={cur.get('waiting', 0):.0f} "
            f"kv={held / blocks:.0%} "
            f"gen={rate('generated_tokens'):.1f} tok/s prefill={rate('prefill_tokens'):.1f} tok/s "
            f"iterations={rate('iterations'):.1f}/s"
        )
        if self.prefix_cache:
            line += f" prefix_hit={rate('prefix_hit_tokens') / max(rate('prefix_query_tokens'), 1e-9):.0%}"
            line += f" cached={cached / blocks:.0%}"
        return line


class SchedulerLoop:
    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        executor: DualWorkerExecutor,
        tracker: InflightTracker,
        metrics: Metrics,
        tracer: Tracer,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.executor = executor
        self.tracker = tracker
        self.metrics = metrics
        self.tracer = tracer
        self.max_inflight = config.max_inflight if config.overlap else 1
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.dead: EngineDeadError | None = None  # set once, under _life_lock
        self._life_lock = threading.Lock()  # orders send() against the final failure and going idle
        self._keepalive: object | None = None  # the Engine, while a command for it is pending
        self._resumed: list[Command] = []  # the command that woke the idle thread
        # Owned by the scheduler thread from here on.
        self._inflight: dict[int, Batch] = {}  # submitted, not yet processed
        self._handles: dict[str, RequestHandle] = {}
        self._drain_waiters: list[Drain] = []
        self._idle_count_at = 0.0  # when prefix_cache_idle_blocks is next counted
        # Far above the pipeline depth: a legitimate run of result-less iterations is a few deep.
        self._watchdog = ProgressWatchdog(config.stall_timeout_s, min_iterations=16 * self.max_inflight)
        self.thread = threading.Thread(target=self._main, name="minisgl-scheduler", daemon=True)

    # ---- caller threads ----
    def send(self, cmd: Command, keepalive: object) -> None:
        """Queue a command; raises EngineDeadError once the loop has stopped. `keepalive` (the
        Engine) is held until the loop is idle again."""
        with self._life_lock:  # pairs with _fail_all: nothing is queued after the final drain
            if self.dead is not None:
                raise EngineDeadError(f"engine is not running: {self.dead}") from self.dead
            if self._keepalive is None:
                self._keepalive = keepalive
            self.inbox.put(cmd)
        self.tracker.wake()  # the loop may be blocked waiting for completions

    def call(self, fn: Callable[[], Any], keepalive: object) -> Any:
        fut: Future = Future()
        self.send(Call(fn, fut), keepalive)
        return fut.result()

    def shutdown(self) -> None:
        """Stop the scheduler thread, then the executor's workers and the metrics thread (from
        Engine.close, or the finaliser of an Engine dropped without it: it holds no Engine)."""
        self.inbox.put(Stop())
        self.tracker.wake()
        current = threading.current_thread()
        if self.thread is not current and self.thread.is_alive():
            self.thread.join()
        if current in self.executor.threads:  # collected on a worker thread: it cannot join itself
            threading.Thread(target=self._close_workers, name="minisgl-closer", daemon=True).start()
        else:
            self._close_workers()

    def _close_workers(self) -> None:
        self.executor.close()
        self.metrics.close()

    def num_waiting(self) -> int:
        """Requests not admitted yet, plus commands not yet read (an upper bound, lock-free)."""
        return len(self.scheduler.waiting) + self.inbox.qsize()

    # ---- the scheduler thread ----
    def _main(self) -> None:
        while True:
            if not self._run_until_idle():
                self._keepalive = None  # stopped: nothing is pending any more
                return
            keepalive = None
            with self._life_lock:  # pairs with send: from here on a sender sets _keepalive again
                try:
                    self._resumed.append(self.inbox.get_nowait())  # a command raced in: stay busy
                    continue
                except queue.Empty:
                    keepalive, self._keepalive = self._keepalive, None
            del keepalive  # may collect the Engine here: its finaliser only queues Stop
            self._resumed.append(self.inbox.get())

    def _run_until_idle(self) -> bool:
        """Run until idle (True) or stopped for good (False)."""
        sched, tracker, limit = self.scheduler, self.tracker, self.max_inflight
        done: list[int] = []
        try:
            while True:
                idle = not sched.has_work() and not self._inflight and not done
                if idle and not self._resumed:
                    return True
                cmds, self._resumed = self._resumed, []
                while True:
                    try:
                        cmds.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    self._dispatch(cmd)
                if any(isinstance(cmd, Stop) for cmd in cmds):
                    self._fail_all(EngineDeadError("engine closed"))
                    return False
                done += tracker.drain()
                if self.executor.error is not None:
                    raise self.executor.error
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
                self._watch(len(done))
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

    def _dispatch(self, cmd: Command) -> None:
        match cmd:
            case Add(reqs):
                head = reqs[0]
                if head.request_id in self._handles:
                    head.handle._post_error(InvalidRequestError(f"duplicate request_id {head.request_id!r}"))
                    return
                self._handles[head.request_id] = head.handle
                for req in reqs:  # in index order: sample 0 is admitted first and computes the prompt
                    self.scheduler.add(req)
            case Abort(request_id):
                self.scheduler.abort(request_id)
            case Drain():
                self._drain_waiters.append(cmd)
            case Call(fn, fut):
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - reported to the caller
                    fut.set_exception(e)
            case Stop():
                pass  # acted on after the batch of commands it came with

    def _watch(self, completed: int) -> None:
        sched = self.scheduler
        try:
            self._watchdog.observe(sched.progress, completed, busy=sched.has_work())
        except EngineStalledError as e:
            self.metrics.add("stalls")
            pool = sched.pool
            log.error(
                "%s; running=%d waiting=%d free_blocks=%d pending_blocks=%d",
                e,
                len(sched.running),
                len(sched.waiting),
                pool.num_free,
                pool.num_pending,
            )
            raise

    def _fill_pipeline(self, limit: int) -> None:
        """Plan and submit iterations while fewer than `limit` are in flight (backpressure:
        the scheduler runs at most `limit` iterations ahead of the results it has seen)."""
        while self.tracker.inflight < limit:
            t0 = time.perf_counter()
            batch = self.scheduler.schedule()
            if batch is None:
                break
            self._inflight[batch.iteration] = batch
            self.executor.submit(build_inputs(batch, self.config.block_size))
            self.tracer.span("scheduler", f"plan {batch.iteration}", t0, time.perf_counter())
            prefill = sum(e.length for e in batch.prefill)
            self.metrics.add("iterations")
            self.metrics.add("prefill_tokens", prefill)
            self.metrics.add("decode_tokens", len(batch.decode))
            if DEBUG_LOG:
                log.debug(
                    "iteration %d: %d decode entries, %d prefill tokens, waits for %d",
                    batch.iteration,
                    len(batch.decode),
                    prefill,
                    batch.depends_on,
                )

    def _process(self, done: list[int]) -> None:
        """Apply completed iterations in order and deliver what they produced."""
        sched = self.scheduler
        for it in done:
            t0 = time.perf_counter()
            batch = self._inflight.pop(it)
            updates = sched.complete(batch, self.executor.take_result(it))
            self.metrics.add("generated_tokens", len(updates))
            new_tokens: dict[int, list[int]] = {}
            for req, ids in updates:
                new_tokens[id(req)] = ids
                if req.finish_reason is None:
                    req.handle._post_delta(req.delta(ids))
            self._deliver_finished(new_tokens)
            self.tracer.span("scheduler", f"process {it}", t0, time.perf_counter())
        self._deliver_finished({})  # aborts
        self.metrics.set("running", len(sched.running))
        self.metrics.set("waiting", len(sched.waiting))
        self.metrics.set("kv_used_blocks", sched.pool.num_blocks - sched.pool.num_free)
        if sched.prefix.cache is not None:
            self.metrics.set("prefix_cache_blocks", sched.prefix.num_blocks)
            now = time.monotonic()
            if now >= self._idle_count_at or not sched.running:  # a walk of the tree: twice a second
                self._idle_count_at = now + 0.5
                self.metrics.set("prefix_cache_idle_blocks", sched.prefix.cache.num_idle_blocks())

    def _deliver_finished(self, new_tokens: dict[int, list[int]]) -> None:
        """Post each finished sample's final delta; a request's result once all its samples are
        done. A sample that failed fails its request: the handle gets the error, the other samples
        are aborted (they finish in the next pass of this loop, and post nothing)."""
        while finished := self.scheduler.take_finished():
            self._deliver(finished, new_tokens)

    def _deliver(self, finished: list[Request], new_tokens: dict[int, list[int]]) -> None:
        for req in finished:
            group = req.group
            group.unfinished -= 1
            if group.error is None and req.error is not None:
                group.error = req.error
                req.handle._post_error(req.error)
                self.scheduler.abort(req.request_id)
            elif group.error is None:
                req.handle._post_delta(req.delta(new_tokens.get(id(req), [])))
                group.outputs[req.index] = req.output()
            if group.unfinished:
                continue
            self._handles.pop(req.request_id, None)
            self.metrics.add("requests_finished")
            if group.error is None:
                req.handle._post_result(group.result())

    def check_invariants(self) -> dict[str, int]:
        """Scheduler thread: the scheduler's counts plus the iterations in flight."""
        return {**self.scheduler.check_invariants(), "inflight": len(self._inflight)}

    def _resolve_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        if any(w.flush_cache for w in waiters):
            self.scheduler.flush_cache()  # nothing is in flight, so evicted blocks are FREE at once
        for w in waiters:
            try:
                w.future.set_result(self.check_invariants())
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                w.future.set_exception(e)

    def _fail_all(self, err: EngineDeadError, cause: BaseException | None = None) -> None:
        if cause is not None:
            err.__cause__ = cause
        with self._life_lock:
            self.dead = err
        for handle in self._handles.values():
            handle._post_error(err)
        self._handles.clear()
        # Commands still in the inbox (raced with the failure) are failed too.
        while True:
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break
            match cmd:
                case Add(reqs):
                    reqs[0].handle._post_error(err)
                case Call(_, fut) | Drain(fut, _):
                    fut.set_exception(err)
        for w in self._drain_waiters:
            w.future.set_exception(err)
        self._drain_waiters.clear()
