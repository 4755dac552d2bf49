"""Running the app: uvicorn in the foreground (the CLI) or in a background thread (tests, benches)."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minisgl_backend.errors import ConfigError, MissingExtraError

log = logging.getLogger("minisgl.serve")


def _require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(
            f"`minisgl serve` needs the serve extra: pip install 'minisgl[serve]' ({e})"
        ) from e


def create_app(
    engine: Any,
    model_name: str | None = None,
    api_key: str | None = None,
    owns_engine: bool = False,
    enable_metrics: bool = True,
    limits: Any = None,
    allowed_hosts: frozenset[str] | None = None,
    reasoning_parser: str | None = None,
) -> Any:
    """The API over one in-process `engine`. `owns_engine`: close it when the app shuts down.
    `limits`: a serve.guard.ServeLimits (its defaults unless given). `allowed_hosts`: the `Host`
    names answered (serve.guard.allowed_hosts); None answers any."""
    _require_extra()
    from minisgl_backend.serve.app import build_app
    from minisgl_backend.serve.backend import EngineBackend, public_model_ref
    from minisgl_backend.serve.metrics import ServeMetrics

    name = model_name or public_model_ref(str(engine.config.model))
    metrics = ServeMetrics(engine, name) if enable_metrics else None
    backend = EngineBackend(engine, metrics, owns_engine=owns_engine)
    return build_app(
        backend,
        name,
        api_key,
        owns_backend=owns_engine,
        enable_metrics=enable_metrics,
        limits=limits,
        allowed_hosts=allowed_hosts,
        reasoning_parser=reasoning_parser,
    )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a ConfigError saying why not (the port is taken, the address is not
    this machine's). The command binds it before loading the model, so that a port in use is told
    at once rather than after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (another server runs there? pick another --port)" if e.errno == errno.EADDRINUSE else ""
        shown = f"[{host}]" if ":" in host else host
        raise ConfigError(f"cannot serve on {shown}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _server(app: Any, config: Any, shutdown_timeout: float = 0.0) -> Any:
    """A uvicorn Server whose stop (a signal, or `should_exit`) first settles the app's requests.
    With `shutdown_timeout` > 0 the first signal drains: requests that arrive get a 503 (/health
    too), the ones in flight get up to that many seconds to finish, then the rest are aborted and
    uvicorn stops; a second signal stops at once. Otherwise the requests in flight are aborted at
    once, so open streams end then rather than at uvicorn's own timeout."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        _loop: asyncio.AbstractEventLoop | None = None
        _draining = False
        _drain_task: asyncio.Task | None = None

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def _on_loop(self, fn: Any) -> None:
            # a signal handler must not take the engine's locks itself: defer to the loop
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(fn)
            else:
                fn()

        def handle_exit(self, sig: int, frame: Any) -> None:
            if shutdown_timeout > 0 and not self._draining and not self.should_exit and self._loop:
                self._draining = True
                self._on_loop(self._begin_drain)
                return
            super().handle_exit(sig, frame)
            self._on_loop(self._stop_requests)

        def _stop_requests(self) -> None:
            """Abort the requests in the engine; those still being prepared get a 503."""
            app.state.minisgl.begin_shutdown()
            app.state.server.pool.stop()

        def _begin_drain(self) -> None:
            self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            drain = app.state.drain
            log.info(
                "stopping: new requests get a 503; %d in flight have up to %g s (--shutdown-timeout)",
                drain.inflight,
                shutdown_timeout,
            )
            left = await drain.wait_idle(shutdown_timeout)
            if left:
                log.warning("%d requests still in flight after %g s: aborted", left, shutdown_timeout)
            self._stop_requests()
            self.should_exit = True

    return Server(config)


def _uvicorn_config(app: Any, access_log: bool = False, **kw: Any) -> Any:
    import uvicorn

    from minisgl_backend.serve.guard import guarded_protocol

    limits = app.state.limits
    # Streams still open at shutdown are cancelled after this long (their requests are aborted).
    return uvicorn.Config(
        app,
        log_level=kw.pop("log_level", "warning"),
        timeout_graceful_shutdown=5,
        access_log=access_log,
        lifespan="on",
        http=guarded_protocol(limits),  # h11 + header timeout + connection cap (serve/guard.py)
        h11_max_incomplete_event_size=limits.max_header_bytes,
        ws="none",
        **kw,
    )


def run_server(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    log_level: str = "info",
    limits: Any = None,
    access_log: bool = False,
    extra_hosts: Sequence[str] | None = None,
    shutdown_timeout: float = 0.0,
    sock: socket.socket | None = None,
    reasoning_parser: str | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's handlers: stop accepting, finish or cancel in-flight
    requests, then the lifespan closes the engine). Blocks. `log_level` is uvicorn's and the
    server's own (`minisgl.serve`: the start banner at INFO, warnings about refused clients).
    `extra_hosts`: `Host` names answered besides `host` and the loopback names (--allowed-hosts).
    `shutdown_timeout`: seconds the requests in flight at a signal get to finish (see `_server`).
    `sock`: the socket `bind(host, port)` made (else it is bound here)."""
    from minisgl_backend.serve.guard import allowed_hosts

    hosts = allowed_hosts(host, extra_hosts)
    app = create_app(
        engine,
        model_name,
        api_key,
        owns_engine=True,
        limits=limits,
        allowed_hosts=hosts,
        reasoning_parser=reasoning_parser,
    )
    sock = sock or bind(host, port)
    bound = sock.getsockname()
    logging.getLogger("minisgl.serve").setLevel(log_level.upper())
    log.info(
        "minisgl serve: %s on http://%s:%d/v1 (model %r)",
        engine.config.model,
        host,
        bound[1],
        model_name or str(engine.config.model),
    )
    config = _uvicorn_config(app, access_log=access_log, log_level=log_level)
    server = _server(app, config, shutdown_timeout)
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown), then restores the previous handlers and
    # re-raises the signal; these make that re-raise a no-op, so a requested stop exits 0 quietly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.close()  # idempotent; the lifespan normally did it already


@dataclass
class BackgroundServer:
    """A server on a thread of this process (tests, bench-serve): `.url`, `.app`, `.stop()`."""

    app: Any
    server: Any
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> Any:
        return self.app.state.minisgl

    def stop(self, timeout: float = 30) -> None:
        self.state.begin_shutdown()
        self.server.should_exit = True
        self.thread.join(timeout)


def start_in_thread(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    model_name: str | None = None,
    owns_engine: bool = False,
    limits: Any = None,
    extra_hosts: Sequence[str] | None = None,
    shutdown_timeout: float = 0.0,
    reasoning_parser: str | None = None,
) -> BackgroundServer:
    """Start serving `engine` on a background thread; returns once the server accepts connections.
    port 0 picks a free port (bound here, so there is no race for it). `limits`: a ServeLimits.
    `extra_hosts`: `Host` names answered besides `host` and the loopback names. `shutdown_timeout`:
    what `.server.handle_exit(signal)` gives the requests in flight (`stop()` aborts them at once)."""
    from minisgl_backend.serve.guard import allowed_hosts

    hosts = allowed_hosts(host, extra_hosts)
    app = create_app(
        engine,
        model_name,
        api_key,
        owns_engine=owns_engine,
        limits=limits,
        allowed_hosts=hosts,
        reasoning_parser=reasoning_parser,
    )
    sock = bind(host, port)
    server = _server(app, _uvicorn_config(app), shutdown_timeout)
    started = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        import asyncio

        async def main() -> None:
            config = server.config
            if not config.loaded:
                config.load()
            server.lifespan = config.lifespan_class(config)
            await server.startup(sockets=[sock])  # no signal handlers: not the main thread
            started.set()
            if server.should_exit:
                return
            await server.main_loop()
            await server.shutdown(sockets=[sock])

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported to the starter
            failed.append(e)
        finally:
            started.set()
            sock.close()

    thread = threading.Thread(target=run, name="minisgl-serve", daemon=True)
    thread.start()
    started.wait(60)
    if failed:
        raise failed[0]
    return BackgroundServer(app, server, thread, host, sock.getsockname()[1])
