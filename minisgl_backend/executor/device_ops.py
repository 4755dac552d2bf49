"""The CUDA executor's device operations behind one seam: streams, events, the wait of a stream on
an event, non-blocking copies between pinned host memory and the device, keeping device memory alive
for a second stream, and the host callback that reports an iteration's copies done.

`CudaOps` is the real thing. `SimulatedOps` runs the same executor code on CPU tensors with the
hazards a GPU has, so a test on a machine without one catches a missing wait or a buffer reused too
early (tests/engine/test_simulated_streams.py):

- a copy stream (`stream("copy")`) runs its operations in order on a thread of its own, each after
  a random delay: its copies complete late, and a host callback runs on that thread, not the
  caller's;
- the destination of a copy holds poison (NaN for floats, the dtype's maximum for integers: an index
  out of any range) from the moment the copy is issued until it lands, and a copy reads its source
  when it runs, not when it is issued;
- a compute stream (`stream("compute")`), and the default stream of any thread, runs each
  operation at once on the issuing thread, as the torch ops of a forward on CPU tensors do; its
  wait on an event blocks that thread until the event has passed: an event wait really waits;
- the forward has always finished on CPU tensors when a copy of its output is issued, so values
  cannot show a copy stream that skips its wait on the forward. The order can: each `use` of the
  compute stream opens a new span of work, an event records the span it closes, and a copy of a
  device tensor to the host on another stream raises StreamHazardError unless that stream has
  waited on an event recorded after the compute stream's latest span.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from minisgl_backend.executor.graphs import DecodeGraphs
from minisgl_backend.executor.tracker import InflightTracker

STREAM_ROLES = ("compute", "copy")


class DeviceOps(Protocol):
    device: torch.device
    pin: bool  # whether host staging buffers are page-locked (what a non-blocking copy needs)

    def stream(self, role: str) -> Any: ...  # role: "compute" or "copy"
    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def event(self, timing: bool = False) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait(self, stream: Any, event: Any) -> None: ...  # later work on `stream` waits for `event`
    def event_synchronize(self, event: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def h2d(self, host: torch.Tensor) -> torch.Tensor: ...  # non-blocking, on the current stream
    def d2h(self, src: torch.Tensor, host: torch.Tensor) -> None: ...  # non-blocking, current stream
    def to_host(self, src: torch.Tensor) -> torch.Tensor: ...  # blocking, ordered on the current stream
    def keep_for(self, t: torch.Tensor, stream: Any) -> None: ...  # t is read on `stream` too
    def host_callback(self, stream: Any, tracker: InflightTracker, iteration: int) -> None: ...
    def synchronize(self) -> None: ...
    def capture(self, graphs: DecodeGraphs, stream: Any) -> None: ...  # the buckets' CUDA graphs
    def release_cached(self) -> None: ...  # the allocator's unused cached memory back to the device


class CudaOps:
    """The device operations on a CUDA device."""

    pin = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self, role: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def event_synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def h2d(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def d2h(self, src: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(src, non_blocking=True)

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        return src.cpu()

    def keep_for(self, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        t.record_stream(stream)

    def host_callback(self, stream: torch.cuda.Stream, tracker: InflightTracker, iteration: int) -> None:
        tracker.cuda_host_complete(stream.cuda_stream, iteration)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture(self, graphs: DecodeGraphs, stream: torch.cuda.Stream) -> None:
        graphs.capture(stream)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with what no correct read may see: NaN, or an index past any tensor's end."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class StreamHazardError(RuntimeError):
    """A simulated copy that a GPU could run before the work that writes its source."""


class SimStream:
    """A simulated stream: operations run in issue order, on a thread of this stream (after a random
    delay of up to `delay_s` each), or at once on the issuing thread when `inline`."""

    def __init__(self, name: str, delay_s: float = 0.0, inline: bool = False) -> None:
        self.name = name
        self._delay_s = delay_s
        self._inline = inline
        self.inline = inline
        self.span = 0  # inline streams: how many `use` blocks have issued work on it
        self.waited: dict[SimStream, int] = {}  # per other stream: the latest span this one waited for
        self.error: BaseException | None = None
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        if not inline:
            threading.Thread(target=self._run, name=f"sim-stream-{name}", daemon=True).start()

    def submit(self, op: Callable[[], None]) -> None:
        if self._inline:
            op()
        else:
            self._q.put(op)

    def close(self) -> None:
        if not self._inline:
            self._q.put(None)

    @torch.inference_mode()  # copies into tensors made under the executor's inference mode
    def _run(self) -> None:
        while (op := self._q.get()) is not None:
            if self._delay_s:
                time.sleep(random.uniform(0, self._delay_s))
            try:
                op()
            except BaseException as e:  # noqa: BLE001 - kept for the test to see; the stream goes on
                self.error = self.error or e


class SimEvent:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.at = 0.0  # perf_counter when the stream passed it
        self.stream: SimStream | None = None  # where it was last recorded, and in which span
        self.span = 0


class SimulatedOps:
    """DeviceOps over CPU tensors with late copies and poisoned destinations (module docstring)."""

    pin = False

    def __init__(self, delay_s: float = 0.002) -> None:
        self.device = torch.device("cpu")
        self._delay_s = delay_s
        self._local = threading.local()
        self.streams: list[SimStream] = []

    def _current(self) -> SimStream:
        cur = getattr(self._local, "stream", None)
        if cur is None:  # the issuing thread's own stream, as a GPU's default stream
            cur = self._local.stream = SimStream(threading.current_thread().name, inline=True)
        return cur

    def stream(self, role: str) -> SimStream:
        if role not in STREAM_ROLES:
            raise ValueError(f"stream role must be one of {', '.join(STREAM_ROLES)}, got {role!r}")
        s = SimStream(f"{role}{len(self.streams)}", self._delay_s, inline=role == "compute")
        self.streams.append(s)
        return s

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[SimStream]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        if stream.inline:
            stream.span += 1
        try:
            yield stream
        finally:
            self._local.stream = before

    def event(self, timing: bool = False) -> SimEvent:
        return SimEvent()

    def record(self, event: SimEvent, stream: SimStream) -> None:
        event.done.clear()
        event.stream, event.span = stream, stream.span

        def passed() -> None:
            event.at = time.perf_counter()
            event.done.set()

        stream.submit(passed)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if event.stream is not None:  # issue order is stream order: later work here is after it
            stream.waited[event.stream] = max(stream.waited.get(event.stream, 0), event.span)

        def passed() -> None:
            event.done.wait()

        stream.submit(passed)

    def event_synchronize(self, event: SimEvent) -> None:
        event.done.wait()

    def elapsed_ms(self, start: SimEvent, end: SimEvent) -> float:
        return (end.at - start.at) * 1000.0

    def h2d(self, host: torch.Tensor) -> torch.Tensor:
        dst = poison_(torch.empty_like(host))
        self._current().submit(lambda: _copy(dst, host))
        return dst

    def d2h(self, src: torch.Tensor, host: torch.Tensor) -> None:
        cur = self._current()
        for s in self.streams:
            if s.inline and s is not cur and cur.waited.get(s, 0) < s.span:
                raise StreamHazardError(
                    f"a copy to the host on stream {cur.name} is issued without waiting for the work "
                    f"issued on stream {s.name} (span {s.span}; waited for {cur.waited.get(s, 0)})"
                )
        poison_(host)
        self._current().submit(lambda: _copy(host, src))

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        out = poison_(torch.empty_like(src))
        landed = SimEvent()
        self._current().submit(lambda: _copy(out, src))
        self.record(landed, self._current())
        landed.done.wait()
        return out

    def keep_for(self, t: torch.Tensor, stream: SimStream) -> None:
        """Nothing to do: a CPU tensor lives while an issued operation's closure refers to it."""

    def host_callback(self, stream: SimStream, tracker: InflightTracker, iteration: int) -> None:
        stream.submit(lambda: tracker.complete(iteration))

    def synchronize(self) -> None:
        for s in self.streams:
            ev = SimEvent()
            self.record(ev, s)
            ev.done.wait()

    def capture(self, graphs: DecodeGraphs, stream: SimStream) -> None:
        """Nothing to capture: the buckets run eagerly over their static buffers."""

    def release_cached(self) -> None:
        """CPU tensors have no cache to give back."""

    def close(self) -> None:
        for s in self.streams:
            s.close()

    @property
    def errors(self) -> list[BaseException]:
        return [s.error for s in self.streams if s.error is not None]
