"""In-flight iteration tracker: backpressure counter + completion queue.

The executor calls ``begin()`` before submitting an iteration (at most ``max_inflight`` may be
submitted-but-unfinished: the scheduler runs ahead of the device by a bounded amount, so a finished
request is noticed within a few iterations and memory held for in-flight work stays bounded); the
completion side calls ``complete(id)`` — from a CUDA host function,
a worker thread, or the scheduler itself — and the scheduler's main thread collects finished ids in bulk
with ``wait``/``drain``. Slot state changes only after that hand-over, on the main thread, so no
slot is reclaimed while another thread still works on it.

Two implementations with one interface:
- ``native``: ``minisgl_backend.native._native.InflightTracker`` (csrc/inflight_tracker.cpp). ``wait``
  releases the GIL; on CUDA the completion is a C host function that only counts and pushes, so it
  never takes the GIL or touches a Python object on the driver's callback thread.
- ``python``: :class:`PyInflightTracker`, kept selectable (``callback_impl: python``) so the cost of
  Python completion callbacks can be measured against the native ones (``python -m
  minisgl_backend.bench.callbacks``), and used when the extension was not built.
"""

from __future__ import annotations

import queue
import threading
import warnings
import weakref
from typing import Any, Protocol

VALID_IMPLS = ("native", "python")


class InflightTracker(Protocol):
    """What the executor relies on; both implementations satisfy it."""

    def begin(self) -> None: ...
    def complete(self, iteration_id: int) -> None: ...  # RuntimeError when nothing is in flight
    def wait(self, timeout_s: float) -> list[int]: ...
    def drain(self) -> list[int]: ...
    def wake(self) -> None: ...
    def cuda_host_complete(self, stream_handle: int, iteration_id: int) -> None: ...
    @property
    def inflight(self) -> int: ...
    @property
    def max_inflight(self) -> int: ...


class PyInflightTracker:
    """Pure-Python twin of the native tracker, on one ``threading.Condition``.

    Every ``complete`` takes the GIL and a Python lock, contending with the scheduler thread for
    both on every iteration: which is why this is the fallback / measurement path, not the default.
    """

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self._max = int(max_inflight)
        self._inflight = 0
        self._cond = threading.Condition()
        self._done: list[int] = []
        self._woken = False
        self._events: queue.SimpleQueue[Any] | None = None  # (event, id) for the CUDA poller thread

    def begin(self) -> None:
        with self._cond:
            if self._inflight >= self._max:
                raise RuntimeError(
                    f"InflightTracker.begin: {self._inflight} iterations in flight, max_inflight={self._max}"
                )
            self._inflight += 1

    def complete(self, iteration_id: int) -> None:
        with self._cond:
            if self._inflight <= 0:  # more completions than begins: a caller bug, never a negative count
                raise RuntimeError(
                    f"InflightTracker.complete({int(iteration_id)}): no iteration is in flight"
                )
            self._inflight -= 1
            self._done.append(int(iteration_id))
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> list[int]:
        if timeout_s != timeout_s:
            raise ValueError("timeout_s must be a number")
        with self._cond:
            if timeout_s > 0:
                self._cond.wait_for(
                    lambda: bool(self._done) or self._woken, min(timeout_s, threading.TIMEOUT_MAX)
                )
            self._woken = False
            out, self._done = self._done, []
        return out

    def drain(self) -> list[int]:
        with self._cond:
            out, self._done = self._done, []
        return out

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def max_inflight(self) -> int:
        return self._max

    def cuda_host_complete(self, stream_handle: int, iteration_id: int) -> None:
        """The slow Python path: torch has no Python-level host-function launch, so record
        a CUDA event on the stream and let a poller thread ``event.synchronize()`` then ``complete(id)``.
        Completions are observed in submission order (one FIFO poller), an event-based sync boundary."""
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("cuda_host_complete: CUDA is not available to torch")
        event = torch.cuda.Event()
        event.record(torch.cuda.ExternalStream(stream_handle))
        if self._events is None:
            self._events = queue.SimpleQueue()
            _start_poller(self, self._events)
        self._events.put((event, int(iteration_id)))

    def __repr__(self) -> str:
        return f"<PyInflightTracker inflight={self._inflight} max_inflight={self._max}>"


def _start_poller(tracker: PyInflightTracker, events: queue.SimpleQueue[Any]) -> None:
    # The thread holds only a weak reference, so a dropped tracker is collected; its finalizer sends the
    # stop sentinel. Pending events of a dropped tracker are still synchronized (nobody reads them after).
    ref = weakref.ref(tracker)

    def run() -> None:
        while (item := events.get()) is not None:
            event, iteration_id = item
            event.synchronize()
            if (live := ref()) is not None:
                live.complete(iteration_id)
                del live

    threading.Thread(target=run, name="minisgl-cuda-event-poller", daemon=True).start()
    weakref.finalize(tracker, events.put, None)


_native_module: Any = None
_native_checked = False
_warned_fallback = False


def _native() -> Any:
    global _native_module, _native_checked
    if not _native_checked:
        try:
            from minisgl_backend.native import _native as mod  # type: ignore[attr-defined]
        except ImportError:
            mod = None
        _native_module, _native_checked = mod, True
    return _native_module


def native_available() -> bool:
    """True if the C++ extension ``minisgl_backend.native._native`` was built and imports."""
    return _native() is not None


def make_tracker(impl: str, max_inflight: int) -> InflightTracker:
    """``impl`` is ``callback_impl`` from the config: "native" (default) or "python"."""
    global _warned_fallback
    if impl not in VALID_IMPLS:
        raise ValueError(f"callback_impl must be one of {', '.join(map(repr, VALID_IMPLS))}, got {impl!r}")
    if impl == "native":
        mod = _native()
        if mod is not None:
            return mod.InflightTracker(max_inflight)
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                "callback_impl='native' but minisgl_backend.native._native is not built (see the install "
                "log); using the slower Python callback path (PyInflightTracker)",
                RuntimeWarning,
                stacklevel=2,
            )
    return PyInflightTracker(max_inflight)
