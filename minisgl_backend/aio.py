"""asyncio bridges to a RequestHandle, shared by the HTTP server and the LangChain adapter.

The engine's threads never touch an event loop's state: they hand results over with
`call_soon_threadsafe`, and a loop that has closed (its server shutting down, its caller gone) is
simply no longer told.
"""

from __future__ import annotations

import asyncio
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
