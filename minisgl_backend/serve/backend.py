"""What the HTTP routes run against: a `Backend` that accepts requests and hands back `Stream`s.

The routes (`serve/routes/`) never touch an Engine directly, so the same handlers serve one
in-process engine (`EngineBackend`, `minisgl serve`) or engine replicas on Ray Serve
(`serve/ray_app.py`, `minisgl serve --replicas N`, whose replicas each run an `EngineBackend`).

An `EngineBackend` keeps the server's books on its engine: the live requests (aborted on shutdown)
and the Prometheus metrics, folded on the event loop as soon as each request finishes from a queue
that a done-callback on the scheduler thread fills (one put, no lock). Nothing of a request is kept
once it has ended (tests and debugging can ask for a log of finished ones: `keep_finished`).
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from minisgl_backend.aio import Doorbell, call_soon, result_future
from minisgl_backend.engine import Engine
from minisgl_backend.errors import EngineDeadError, MiniSGLError
from minisgl_backend.handle import RequestHandle
from minisgl_backend.types import RequestOutput, SamplingParams, StreamDelta

Event = StreamDelta | RequestOutput


def public_model_ref(ref: str) -> str:
    """A model reference as clients may see it: a filesystem path becomes its last component (no
    server paths in responses); a registry name (`org/name` included) stays as it is."""
    if os.path.isabs(ref) or ref.startswith((".", "~")) or os.path.exists(ref):
        return os.path.basename(os.path.normpath(ref)) or ref
    return ref


# Token ids in one request up to which it is handed to the engine on the event loop (a few ms of
# checks); more go through a worker thread.
SUBMIT_ON_LOOP_IDS = 8192


class ServerShuttingDownError(MiniSGLError, RuntimeError):
    """The server is stopping and takes no new requests."""


@dataclass
class FinishedRecord:
    request_id: str
    user: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class Stream(ABC):
    """One submitted request, as the routes see it."""

    request_id: str

    @abstractmethod
    def events(self) -> AsyncIterator[Event]:
        """Every StreamDelta, then the RequestOutput; raises the request's error instead."""

    @abstractmethod
    async def result(self) -> RequestOutput:
        """The RequestOutput (or the request's error)."""

    @abstractmethod
    def abort(self) -> None:
        """Stop the request if it still runs (its blocks return to the pool); a no-op otherwise."""


class Backend(ABC):
    """The engine side of the server: what the routes read and call."""

    model_ref: str  # the --model reference (the default served model name)
    model_dir: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int  # the engine's max_logprobs: the most alternatives a request may ask for
    tokenizer: Any  # the app deep-copies it: the event loop encodes with its own copy

    @abstractmethod
    async def submit(
        self,
        prompts: Sequence[Any],
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        user: str | None,
        stream: bool,
    ) -> list[Stream]:
        """Submit every prompt, or none: a failure aborts the ones already queued and raises the
        engine's typed error. `stream`: the caller reads `events()` (else only `result()`)."""

    @abstractmethod
    async def unhealthy(self) -> str | None:
        """Why the backend cannot serve (for /health's 503), or None while it can."""

    @abstractmethod
    async def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition text and its content type."""

    @abstractmethod
    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the running ones (streams end with finish_reason "abort")."""

    @abstractmethod
    def close(self) -> None:
        """Release what the backend owns (the app calls it at shutdown when it owns the backend)."""


# ---------------------------------------------------------------------------------------------- local
class LocalStream(Stream):
    """A request of an in-process Engine. Streamed deltas are taken off the handle on the event loop,
    woken by the scheduler thread (`RequestHandle.set_wakeup`): no thread per stream; a whole result
    through a done-callback."""

    def __init__(self, engine: Engine, handle: RequestHandle, bell: Doorbell | None = None) -> None:
        self.engine, self.handle, self.request_id = engine, handle, handle.request_id
        self.bell = bell  # the server's loop's, shared by its streams; else one of this stream's own

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events in lists of whatever arrived together (one hop per list for a remote reader)."""
        ready = asyncio.Event()
        bell = self.bell or Doorbell(asyncio.get_running_loop())
        handle = self.handle
        handle.set_wakeup(lambda: bell.ring(ready))
        while True:
            ready.clear()
            items: list[Event] = list(handle.take_ready())  # raises the request's error
            if handle.consumed:
                items.append(await result_future(handle))
                yield items
                return
            if items:
                yield items
            else:
                await ready.wait()

    async def events(self) -> AsyncIterator[Event]:
        async for items in self.batches():
            for item in items:
                yield item

    async def result(self) -> RequestOutput:
        return await result_future(self.handle)

    def abort(self) -> None:
        if not self.handle.done():
            try:
                self.engine.abort(self.request_id)
            except EngineDeadError:
                pass


class EngineBackend(Backend):
    """One in-process Engine. `metrics`: a serve.metrics.ServeMetrics over it, or None."""

    def __init__(self, engine: Engine, metrics: Any = None, owns_engine: bool = False) -> None:
        self.engine = engine
        self.metrics = metrics
        self.owns_engine = owns_engine
        self.model_ref = str(engine.config.model)
        self.model_dir = str(engine.model_dir)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_logprobs = engine.config.max_logprobs
        self.tokenizer = engine.tokenizer
        # The newest finished requests, by `user` tag: none (maxlen 0) unless `keep_finished` asks.
        self.finished: collections.deque[FinishedRecord] = collections.deque(maxlen=0)
        # Finished handles, posted by a done-callback on the scheduler thread and folded by whoever
        # reads them: the event loop after each request, /metrics.
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[str, RequestHandle] = {}  # request_id -> handle of every unfinished request
        self._bell: Doorbell | None = None  # wakes the streams of the loop requests come from
        self.shutting_down = False

    def keep_finished(self, n: int) -> None:
        """Keep records of the newest `n` finished requests in `finished` (tests, debugging)."""
        self.finished = collections.deque(self.finished, maxlen=n)

    def submit_now(
        self,
        prompts: Sequence[Any],
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        user: str | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> list[LocalStream]:
        """`submit` without the await (Engine.submit never blocks). `loop`: where finished requests
        are folded (the running one unless given; without one, at the next request or scrape)."""
        if self.shutting_down:
            raise ServerShuttingDownError("the server is shutting down")
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        self.collect()
        bell = self._bell
        if loop is not None and (bell is None or bell.loop is not loop):
            bell = self._bell = Doorbell(loop)
        streams: list[LocalStream] = []
        post, live, fold = self.done.put, self.live, self.collect

        def finished(h: RequestHandle, u: str | None) -> None:  # on the scheduler thread: keep it tiny
            live.pop(h.request_id, None)
            post((h, u))
            if loop is not None:  # folded at once: an idle server holds no output of ended requests
                call_soon(loop, fold)

        try:
            # One HTTP request's prompts take one share of admission between them (scheduling_policy).
            owner = request_ids[0] if request_ids else None
            for p, sp, rid in zip(prompts, params, request_ids):
                h = self.engine.submit(p, sp, request_id=rid, owner=owner)
                live[h.request_id] = h
                h.add_done_callback(lambda h, u=user: finished(h, u))
                streams.append(LocalStream(self.engine, h, bell if loop is not None else None))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def submit(self, prompts, params, request_ids, user, stream) -> list[Stream]:
        if sum(len(p) for p in prompts) > SUBMIT_ON_LOOP_IDS:
            # The engine checks every token id as it takes a prompt: for many long prompts that is
            # seconds of work, which on the event loop would stall every stream and /health.
            loop = asyncio.get_running_loop()
            return list(await asyncio.to_thread(self.submit_now, prompts, params, request_ids, user, loop))
        return list(self.submit_now(prompts, params, request_ids, user))

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        for rid in list(self.live):
            try:
                self.engine.abort(rid)
            except EngineDeadError:
                return

    def collect(self) -> None:
        """Fold finished requests into `finished` and the Prometheus metrics."""
        while True:
            try:
                handle, user = self.done.get_nowait()
            except queue.Empty:
                return
            try:
                out = handle.result(0)
            except BaseException:  # noqa: BLE001 - failed requests carry no output to count
                continue
            self.finished.append(
                FinishedRecord(
                    out.request_id,
                    user,
                    out.finish_reason,
                    len(out.prompt_token_ids),
                    sum(len(s.token_ids) for s in out.samples),
                )
            )
            if self.metrics is not None:
                self.metrics.observe(out)

    async def unhealthy(self) -> str | None:
        return None if self.engine.is_alive else "the engine is not running"

    def metric_families(self) -> list[Any]:
        self.collect()
        return list(self.metrics.registry.collect()) if self.metrics is not None else []

    async def render_metrics(self) -> tuple[bytes, str]:
        self.collect()
        return self.metrics.render()

    def close(self) -> None:
        if self.owns_engine:
            self.engine.close()
