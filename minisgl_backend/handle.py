"""The caller's side of one request: `result()`, iteration over StreamDelta, done-callbacks.

Callers read it from any thread; the scheduler thread only posts into it (a queue put and a Future
result) and never reads it back, so a handle needs no lock of its own."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from minisgl_backend.errors import ReentrantCallError
from minisgl_backend.types import RequestOutput, StreamDelta


class RequestHandle:
    """The caller's side of a request: `result()` and iteration over StreamDelta.

    The scheduler thread only posts into it (a queue put and a Future result); it never reads it.
    A request of n samples streams the deltas of all of them (each with its sample's `index`) and
    ends after the last sample's final delta.
    """

    def __init__(self, request_id: str, n: int = 1) -> None:
        self.request_id = request_id
        self._unfinished = n  # samples whose final delta the iterator has not yet taken
        self._future: Future[RequestOutput] = Future()
        self._deltas: queue.SimpleQueue[StreamDelta | BaseException] = queue.SimpleQueue()
        self._engine_threads: frozenset[threading.Thread] = frozenset()  # set by the engine
        self._consumed = False  # the final delta (or the error) was taken by an iterator
        self._wakeup: Callable[[], None] | None = None  # see set_wakeup

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
        """The deltas (of every sample), once: iterating again after the last final delta (or the
        error) has been taken returns at once (re-raising that error) instead of blocking forever."""
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
                self._unfinished -= 1
                self._consumed = self._unfinished == 0
            yield item
            if self._consumed:
                return

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        """`fn()` runs on the scheduler thread after each delta or error is posted (keep it tiny: a
        `call_soon_threadsafe`). With `take_ready` it lets an event loop read deltas without a
        thread blocked in the iterator. Set it before the first `take_ready`."""
        self._wakeup = fn

    def take_ready(self) -> list[StreamDelta]:
        """The deltas posted and not yet taken, without blocking (the iterator's bookkeeping: once the
        last final delta is taken, `consumed` is true). Raises the request's error when it is next."""
        out: list[StreamDelta] = []
        while not self._consumed:
            try:
                item = self._deltas.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, BaseException):
                self._consumed = True
                if out:  # hand over what came before the error; the next call raises it
                    return out
                raise item
            if item.finished:
                self._unfinished -= 1
                self._consumed = self._unfinished == 0
            out.append(item)
        if not out and self._consumed and self._future.done() and self._future.exception() is not None:
            raise self._future.exception()  # type: ignore[misc]
        return out

    @property
    def consumed(self) -> bool:
        """Whether the last final delta (or the error) has been taken."""
        return self._consumed

    # --- posted by the scheduler thread ---
    def _post_delta(self, delta: StreamDelta) -> None:
        self._deltas.put(delta)
        if self._wakeup is not None:
            self._wakeup()

    def _post_result(self, out: RequestOutput) -> None:
        self._future.set_result(out)

    def _post_error(self, err: Exception) -> None:
        if not self._future.done():
            self._deltas.put(err)
            self._future.set_exception(err)
            if self._wakeup is not None:
                self._wakeup()
