"""The routes' side of submitted requests: the generation routes' declaration, submitting,
awaiting results while watching for the client to leave, answering them, merging several streams'
events under a bound, and server-sent events.

A client that goes away (mid-stream or while waiting for a non-streamed result) aborts its
requests, so their KV blocks return to the pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from minisgl_backend.serve.backend import Event, Stream
from minisgl_backend.serve.bodies import documented_body
from minisgl_backend.serve.errors import ClientGone, SlowClientError, api_error, error_body
from minisgl_backend.serve.guard import GuardedStreamingResponse
from minisgl_backend.serve.state import ServerState
from minisgl_backend.types import RequestOutput, SamplingParams

F = TypeVar("F", bound=Callable[..., Any])


def abort_all(streams: Sequence[Stream]) -> None:
    for s in streams:
        s.abort()


async def submit(
    state: ServerState,
    prompts: Sequence[Any],
    params: Sequence[SamplingParams],
    prefix: str,
    user: str | None,
    stream: bool,
) -> list[Stream]:
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    return await state.backend.submit(prompts, params, ids, user, stream)


async def _wait_disconnect(request: Request) -> None:
    """Returns once the client has gone away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def results_or_disconnect(request: Request, streams: Sequence[Stream]) -> list[RequestOutput]:
    """Every stream's result, unless the client goes away first (ClientGone): then the requests
    are aborted."""
    futs = [asyncio.ensure_future(s.result()) for s in streams]
    gone = asyncio.ensure_future(_wait_disconnect(request))
    pending = set(futs)
    try:
        while pending:
            done, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:  # the client left: stop the work, the answer has no reader
                raise ClientGone()
            pending -= done
            if any(f.exception() is not None for f in done):
                break
        return [f.result() for f in futs]
    finally:
        gone.cancel()
        for f in futs:
            f.cancel()
        abort_all(streams)  # no-op for finished ones


# Answers of up to this many choices, without logprobs, are serialised on the event loop; larger
# ones (or top_logprobs entries per token) take long enough to build that the loop would hold up
# every stream, so they are built on a worker.
SMALL_ANSWER = 8


async def json_answer(
    state: ServerState, respond: Callable[[], str], choices: int, logprobs: bool
) -> Response:
    """The non-streamed answer `respond()` builds (its JSON), of `choices` choices: built on the
    event loop when it is small and has no logprobs, else on a worker (see SMALL_ANSWER)."""
    small = choices <= SMALL_ANSWER and not logprobs
    text = respond() if small else await state.pool.answer(respond)
    return Response(text, media_type="application/json")


class StreamMerger:
    """(index, event) of several streams as they come; an error arrives as (index, exception).
    At most `limit` events wait for the client: past that its requests are aborted (their KV freed)
    and a SlowClientError is queued. `close()` is synchronous: it runs in `finally` blocks that a
    cancelled response may not await in."""

    def __init__(self, streams: Sequence[Stream], limit: int | None = None) -> None:
        self._queue: asyncio.Queue[tuple[int, Event | BaseException]] = asyncio.Queue()
        self._streams, self._limit, self._overflowed = streams, limit, False
        self._tasks = [asyncio.ensure_future(self._forward(i, s)) for i, s in enumerate(streams)]

    async def _forward(self, i: int, s: Stream) -> None:
        try:
            async for ev in s.events():
                if self._overflowed:
                    return
                if self._limit is not None and self._queue.qsize() >= self._limit:
                    self._overflowed = True
                    abort_all(self._streams)
                    self._queue.put_nowait(
                        (i, SlowClientError(f"the client left {self._limit} events unread: aborted"))
                    )
                    return
                self._queue.put_nowait((i, ev))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((i, e))

    async def next(self) -> tuple[int, Event | BaseException]:
        return await self._queue.get()

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()


# ---------------------------------------------------------------------------------------------- SSE
DONE = "data: [DONE]\n\n"

# What /openapi.json adds to a route that streams with `stream: true`.
SSE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the answer; with `stream: true`, its chunks as server-sent events ending in [DONE]",
        "content": {"text/event-stream": {}},
    }
}


def generation_route(
    router: APIRouter, path: str, answer: type[BaseModel], body: type[BaseModel]
) -> Callable[[F], F]:
    """`router.post(path)` for an endpoint that generates: it answers `answer`, or with
    `stream: true` server-sent chunks, and /openapi.json documents its body as `body`. Both OpenAI
    generation endpoints are declared by this one call, so that their documentation stays alike."""
    return router.post(
        path, response_model=answer, responses=SSE_RESPONSES, openapi_extra=documented_body(body)
    )


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


def sse_error(e: BaseException) -> str:
    """A failure in the middle of a stream: the status line is sent, so the error object is an event,
    and the stream still ends with `[DONE]`."""
    err = api_error(e)
    return sse(error_body(err.message, err.type, None, err.code)) + DONE


def sse_response(
    state: ServerState, content: AsyncIterator[str], streams: Sequence[Stream]
) -> GuardedStreamingResponse:
    return GuardedStreamingResponse(
        content,
        state.limits.stream_idle_timeout_s,
        on_close=lambda: abort_all(streams),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
