"""What bounds the work and the waiting any one client can cause: the limits (`ServeLimits`, the
`serve` flags), the HTTP/1.1 protocol guard (header read timeout, connection cap, header size) and
the ASGI guard (request body size and read timeout), and the streamed response that gives up on a
client that stops reading.

Why a protocol subclass: uvicorn has no header read timeout (its keep-alive timer starts only after
a response, and is cancelled by the first byte of the next request), and `limit_concurrency` answers
a plain-text 503 only once a request's headers have arrived, so idle sockets still pile up. h11 (pure
Python, a few µs per request next to milliseconds per token) is used instead of httptools because it
bounds a header block that is still arriving (`max_incomplete_event_size`), where httptools buffers
a header line of any length; `BodyGuard` bounds the complete ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import h11
from starlette.responses import StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from minisgl_backend.errors import ConfigError

log = logging.getLogger("minisgl.serve")

DEFAULT_MAX_CONNECTIONS = 1000
FD_RESERVE = 64  # file descriptors kept for the model, logs and the engine's own use


def default_max_connections() -> int:
    """1000, or fewer when the open-file limit is lower (the limit less FD_RESERVE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, soft - FD_RESERVE))


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-connection bounds (docs/serving.md, "Limits"; each is a `minisgl serve` flag)."""

    max_body_bytes: int = 32 * 1024 * 1024  # a longer body: 413 (before it is read, given Content-Length)
    max_prompts: int = 1024  # prompts in one /v1/completions request
    max_sequences: int = 1024  # n x prompts: sequences one request may queue
    header_timeout_s: float = 10.0  # request line + headers must arrive within this (else closed)
    body_timeout_s: float = 60.0  # the whole body must arrive within this (else 408)
    max_connections: int | None = None  # None: default_max_connections()
    max_header_bytes: int = 16 * 1024  # request line + headers: more is a 431
    max_headers: int = 128  # header fields: more is a 431
    stream_idle_timeout_s: float = 60.0  # a stream whose client reads nothing this long is aborted
    stream_buffer_events: int = 256  # per sequence: undelivered deltas before the stream is aborted
    cpu_workers: int = 2  # threads that tokenise, render templates, parse large bodies, compile grammars
    # characters one request may have tokenised, over all its prompts or messages (tool calls and
    # tools included) and on /tokenize: a bound on the CPU time and memory a request can take
    max_request_chars: int = 4 * 1024 * 1024
    # request body bytes held at once over all requests (each is held until its request ends): past
    # it a request is answered 503, so many slow uploads cannot fill the memory together
    max_buffered_bytes: int = 256 * 1024 * 1024

    def connections(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()

    def check(self) -> None:
        """ConfigError unless every limit is positive."""
        bad = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) is not None and not getattr(self, f.name) > 0
        ]
        if bad:
            raise ConfigError(f"serve limits must be positive: {', '.join(bad)}")


# A 413 (or a 401, 404, ... answered before the body was read) can be sent while the client is
# still uploading. Closing a socket with unread bytes makes the kernel send a reset, which can
# discard the response the client has not read yet; so the rest of the body is read and dropped
# first (a "lingering close", as nginx does), within these bounds. A 408's client is too slow.
LINGER_S = 2.0
LINGER_BYTES_PER_LIMIT = 4  # drained at most: this many times max_body_bytes


def _json_error(status: int, message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


# ---------------------------------------------------------------------------------------------- ASGI
async def _respond(
    send: Callable, status: int, body: bytes, extra: list[tuple[bytes, bytes]], linger: Callable | None = None
) -> None:
    """Send a whole response; with `linger`, await it between the body and the end of the message
    (uvicorn closes a `Connection: close` socket at the end of the message)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body, "more_body": linger is not None})
    if linger is not None:
        await linger()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive: Callable, limit: int) -> None:
    """Read and drop the request body until it ends, the client leaves, LINGER_BYTES_PER_LIMIT x
    `limit` bytes were read or LINGER_S passed (then the socket is closed anyway: the client sends
    far more than allowed, or too slowly to matter)."""
    loop = asyncio.get_running_loop()
    deadline, read, max_bytes = loop.time() + LINGER_S, 0, LINGER_BYTES_PER_LIMIT * limit
    while read <= max_bytes:
        try:
            msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            return
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            return
        read += len(msg.get("body", b""))


class BodyRejected(Exception):
    """The request body is too long (413), too slow (408) or more than the server can hold beside
    the others (503); the app answers it with OpenAI's error object and `Connection: close` (after
    reading and dropping the rest of the body, within LINGER_S; a 408 without)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Buffered:
    """Request body bytes the server holds, over all requests in progress."""

    def __init__(self) -> None:
        self.bytes = 0


class BodyGuard:
    """ASGI middleware: headers over `max_header_bytes` or `max_headers` are answered 431 (h11
    bounds a header block only while it is incomplete: one that arrives whole is parsed first, at
    most asyncio's 256 KiB read); a body over `max_body_bytes` is answered 413 (at once when Content-Length
    says so, else `receive` raises BodyRejected as soon as the bytes read pass it), one not complete
    within `body_timeout_s` 408 (BodyRejected from `receive`). After the body, `receive` is passed
    through untouched (the routes wait on it for a disconnect). A response sent before its body was
    read (a 413, a 401, ...; not a 408) closes the connection after a lingering drain (`_drain`)."""

    def __init__(self, app: Any, limits: ServeLimits, buffered: Buffered | None = None) -> None:
        self.app, self.limits = app, limits
        self.buffered = buffered if buffered is not None else Buffered()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        size = len(scope.get("raw_path") or b"") + sum(len(k) + len(v) + 4 for k, v in headers)
        if size > self.limits.max_header_bytes or len(headers) > self.limits.max_headers:
            msg = (
                f"the request has {len(headers)} header fields, {size} bytes; this server takes at most "
                f"{self.limits.max_headers} fields, {self.limits.max_header_bytes} bytes"
            )
            body = _json_error(431, msg, "invalid_request_error", "headers_too_large")
            await _respond(send, 431, body, [(b"connection", b"close")])
            return
        limit, timeout = self.limits.max_body_bytes, self.limits.body_timeout_s
        too_long = f"the request body is longer than {limit} bytes (--max-body-bytes)"
        busy = "the server holds as many request bodies as it can (--max-buffered-bytes); retry later"
        for k, v in headers:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                body = _json_error(413, too_long, "invalid_request_error", "body_too_large")
                await _respond(send, 413, body, [(b"connection", b"close")], lambda: _drain(receive, limit))
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # done: the whole body was read (or there is none), so the connection can be kept
        read, status = 0, 0
        done = not any(
            k == b"transfer-encoding" or (k == b"content-length" and v != b"0") for k, v in headers
        )

        async def guarded_receive() -> dict:
            nonlocal read, done
            if done:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                why = f"the request body did not arrive within {timeout:g} s (--body-timeout)"
                raise BodyRejected(408, why, "request_timeout") from None
            if msg["type"] == "http.request":
                n = len(msg.get("body", b""))
                read += n
                self.buffered.bytes += n
                if read > limit:
                    raise BodyRejected(413, too_long, "body_too_large")
                if self.buffered.bytes > self.limits.max_buffered_bytes:
                    raise BodyRejected(503, busy, "server_busy")
                done = not msg.get("more_body", False)
            else:
                done = True
            return msg

        async def lingering_send(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                if not done and all(k != b"connection" for k, _ in msg["headers"]):
                    # answered before its body was read (a 401, 404, ...): the body is dropped below
                    # and the connection closed, since the drain may stop before the body ends
                    msg = {**msg, "headers": [*msg["headers"], (b"connection", b"close")]}
            elif status != 408 and not done and not msg.get("more_body", False):
                await send({**msg, "more_body": True})
                await _drain(receive, limit)
                msg = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(msg)

        try:
            await self.app(scope, guarded_receive, lingering_send)
        finally:  # the body is held until its request ends (the app keeps it)
            self.buffered.bytes -= read


# ---------------------------------------------------------------------------------------------- Host
# A web page can make its own host name resolve to 127.0.0.1 after it has loaded ("DNS rebinding");
# its requests then reach a loopback server as same-origin ones, and it can read the answers. They
# still carry the page's name in `Host`, so a server that answers only to its own names is safe.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def host_name(value: str) -> str:
    """The name in a `Host` header (or an --allowed-hosts entry): lower case, without its port or a
    trailing dot; an IPv6 address in brackets."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        v = v[: end + 1] if end > 0 else v
    elif v.count(":") == 1:
        v = v.split(":", 1)[0]
    elif v.count(":") > 1:  # a bare IPv6 address, as --host takes it
        v = f"[{v}]"
    return v.rstrip(".")


def allowed_hosts(bind_host: str, extra: Iterable[str] | None = None) -> frozenset[str] | None:
    """The `Host` names a server bound to `bind_host` answers to: the loopback names, `bind_host`
    itself and `extra` (--allowed-hosts); None (any name) for `*` in `extra`, or when bound to every
    interface (0.0.0.0, ::) with no `extra`: such a server is reached by names it cannot know."""
    names = {host_name(h) for h in extra or () if h.strip()}
    if "*" in names or (bind_host in WILDCARD_HOSTS and not names):
        return None
    if bind_host not in WILDCARD_HOSTS:
        names.add(host_name(bind_host))
    return frozenset(names.union(LOOPBACK_HOSTS))


class HostGuard:
    """ASGI middleware: a request whose `Host` is not one of `allowed` is answered 421 with OpenAI's
    error object (a request without `Host`, which only HTTP/1.0 allows and no browser sends, passes).
    Inside BodyGuard, which drops an unread body and closes the connection after the answer."""

    def __init__(self, app: Any, allowed: frozenset[str] | None) -> None:
        self.app, self.allowed = app, allowed
        self._warned = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            for k, v in scope["headers"]:
                if k == b"host" and host_name(v.decode("latin-1")) not in self.allowed:
                    shown = v.decode("latin-1")[:100]
                    if not self._warned:  # once: a page retrying in a loop must not flood the log
                        self._warned = True
                        log.warning("refused a request for host %r (--allowed-hosts adds names)", shown)
                    msg = (
                        f"this server does not answer to the host {shown!r}; "
                        "start it with --allowed-hosts NAME to allow a name"
                    )
                    body = _json_error(421, msg, "invalid_request_error", "host_not_allowed")
                    await _respond(send, 421, body, [])
                    return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------- drain
class Drain:
    """A server's stop in two steps: while `draining`, requests that arrive get a 503 and the ones
    already in (`inflight`: counted from their headers to the end of their response, streams
    included) are let finish; `wait_idle` returns when none is left. `on_idle` is called each time
    the last request in flight ends. Used on the event loop only."""

    def __init__(self, on_idle: Callable[[], None] | None = None) -> None:
        self.draining = False
        self.inflight = 0
        self._idle: asyncio.Event | None = None
        self._on_idle = on_idle

    def enter(self) -> None:
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            if self._idle is not None:
                self._idle.set()
            if self._on_idle is not None:
                self._on_idle()

    async def wait_idle(self, timeout: float) -> int:
        """Start draining; wait until no request is in flight or `timeout` seconds passed. Returns
        how many requests are still in flight."""
        self.draining = True
        if self.inflight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pass
        return self.inflight


_DRAINING = _json_error(
    503, "the server is shutting down; retry on another server", "service_unavailable", "shutting_down"
)


class DrainGuard:
    """ASGI middleware: counts the requests in flight for `drain`, and answers each request that
    arrives while it drains 503 (`shutting_down`, `Retry-After: 1`), /health included, so that a load
    balancer sends no more. Inside BodyGuard, which drops an unread body and closes the connection."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _respond(send, 503, _DRAINING, [(b"retry-after", b"1"), (b"connection", b"close")])
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


# ---------------------------------------------------------------------------------------------- HTTP/1.1
_REFUSAL = _json_error(
    503,
    "too many open connections (--max-connections); retry later",
    "server_overloaded",
    "too_many_connections",
)


async def _refuse(scope: dict, receive: Callable, send: Callable) -> None:
    await _respond(send, 503, _REFUSAL, [(b"connection", b"close"), (b"retry-after", b"1")])


def guarded_protocol(limits: ServeLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a header read timeout and a connection cap.

    Header timeout: from a connection's start (or the first byte of a later request on it) the
    request line and headers must be complete within `header_timeout_s`, else the connection is
    closed. Cap: a connection beyond `max_connections` open ones gets its request answered 503
    (`too_many_connections`, `Connection: close`, `Retry-After: 1`) as soon as the headers arrive,
    and is closed after 1 s if they do not."""
    cap = limits.connections()

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _timer_cycle: Any = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._refused = len(self.connections) >= cap
            super().connection_made(transport)
            if self._refused:
                self.app = _refuse
                log.warning("connection refused: %d connections are open (--max-connections)", cap)
            self._arm()

        def _arm(self) -> None:
            self._timer_cycle = self.cycle
            timeout = min(1.0, limits.header_timeout_s) if self._refused else limits.header_timeout_s
            self._timer = self.loop.call_later(timeout, self._header_timeout)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _header_timeout(self) -> None:
            self._timer = None
            if self.cycle is self._timer_cycle and not self.transport.is_closing():
                try:  # no new request began in time: close (h11 notes it, uvicorn's bookkeeping follows)
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of a new request on a kept-alive connection
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._timer_cycle:
                self._disarm()  # the request's headers are complete

        _write_timer: asyncio.TimerHandle | None = None

        def pause_writing(self) -> None:
            # The answer no longer fits the socket's buffers: the client is not reading. One that
            # reads nothing for stream_idle_timeout_s is cut off, so that the rest of its answer
            # is not held in memory for ever (a stream's own timer usually ends it first).
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(limits.stream_idle_timeout_s, self._write_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timeout(self) -> None:
            self._write_timer = None
            log.warning(
                "a client read nothing of its answer for %g s (--stream-idle-timeout): disconnected",
                limits.stream_idle_timeout_s,
            )
            self.transport.abort()  # the buffered rest of the answer is dropped; the request ends

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol


# ---------------------------------------------------------------------------------------------- streams
class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that gives up on a client that stops reading: a chunk that cannot be
    handed to the transport within `idle_timeout` (its buffers are full: the client reads nothing)
    ends the response; `on_close` runs and the body iterator is closed, which abort the requests
    (their KV returns to the pool), and uvicorn closes the connection."""

    def __init__(
        self, content: Any, idle_timeout: float, on_close: Callable[[], None] | None = None, **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self.idle_timeout = idle_timeout
        self.on_close = on_close  # sync: also runs when the body never started (the client left first)

    async def stream_response(self, send: Callable) -> None:
        body = self.body_iterator
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in body:
                data = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
                try:
                    await asyncio.wait_for(
                        send({"type": "http.response.body", "body": data, "more_body": True}),
                        self.idle_timeout,
                    )
                except TimeoutError:
                    log.warning(
                        "a streaming client read nothing for %g s (--stream-idle-timeout): aborted",
                        self.idle_timeout,
                    )
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self.on_close is not None:
                self.on_close()
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()
