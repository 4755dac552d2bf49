"""asyncio bridges to a RequestHandle, shared by the HTTP server and the LangChain adapter.

The engine's threads never touch an event loop's state: they hand results over with
`call_soon_threadsafe`, and a loop that has closed (its server shutting down, its caller gone) is
simply no longer told.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from minisgl_backend.handle import RequestHandle
from minisgl_backend.types import RequestOutput


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """`fn(*args)` on `loop`'s thread, from any thread; nothing if the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed while the request ran: nobody is left to tell
        pass


class Doorbell:
    """Wakes many waiters of one event loop from other threads with one `call_soon_threadsafe` per
    burst: the scheduler thread posts a token to every running request in one go, and a cross-thread
    call per request would cost a write to the loop's wake-up socket each (on the scheduler's
    thread) and a read each (on the loop's). Rung while a delivery is pending, a bell only queues."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Event] = []
        self._rung = False

    def ring(self, event: asyncio.Event) -> None:
        """Set `event` on the loop's thread soon; callable from any thread."""
        with self._lock:
            self._pending.append(event)
            if self._rung:
                return
            self._rung = True
        call_soon(self.loop, self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending, self._rung = self._pending, [], False
        for event in pending:
            event.set()


def result_future(handle: RequestHandle) -> asyncio.Future[RequestOutput]:
    """A future of the running loop that settles with the handle's result (or its error)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[RequestOutput] = loop.create_future()

    def settle(h: RequestHandle) -> None:
        if fut.done():
            return
        try:
            fut.set_result(h.result())
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            fut.set_exception(e)

    handle.add_done_callback(lambda h: call_soon(loop, settle, h))
    return fut
