"""The OpenAI-compatible HTTP API (FastAPI) over a `Backend` (serve/backend.py): one in-process
Engine, or engine replicas on Ray Serve behind this same app (serve/ray_app.py).

Every request is handed to the backend at once (`Engine.submit` never blocks), so concurrent HTTP
requests share the continuous batch. The routes live in serve/routes/, one module per endpoint
family; what they share is the `ServerState` on `app.state.server` (serve/state.py).

/docs and /openapi.json need no API key (as vLLM's): the schema shows what the server accepts,
nothing of the model or its host.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from minisgl_backend.chat.reasoning import REASONING_PARSERS
from minisgl_backend.serve.backend import Backend
from minisgl_backend.serve.errors import add_error_handlers
from minisgl_backend.serve.guard import BodyGuard, Buffered, Drain, DrainGuard, HostGuard, ServeLimits
from minisgl_backend.serve.heap import HeapTrimmer
from minisgl_backend.serve.routes import chat, completions, health, metrics, models, tokenizer
from minisgl_backend.serve.state import ServerState


def build_app(
    backend: Backend,
    model_name: str | None = None,
    api_key: str | None = None,
    owns_backend: bool = False,
    enable_metrics: bool = True,
    limits: ServeLimits | None = None,
    allowed_hosts: frozenset[str] | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The API over `backend`. `owns_backend`: close it when the app shuts down (the CLI's case).
    `limits`: the per-request bounds (ServeLimits' defaults unless given). `allowed_hosts`: the
    `Host` names answered (guard.allowed_hosts), others get a 421; None answers any.
    `reasoning_parser` (REASONING_PARSERS): chat replies' reasoning traces go to `reasoning`.
    `app.state.minisgl` is the backend (tests and the runner reach the engine side through it)."""
    limits = limits or ServeLimits()
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning parser {reasoning_parser!r}: minisgl splits <think>...</think> traces, which "
            f"{', '.join(REASONING_PARSERS)} write"
        )
    state = ServerState.for_backend(
        backend, model_name, api_key, owns_backend, limits, reasoning=reasoning_parser is not None
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        state.pool.close()
        if state.owns_backend:  # uvicorn has stopped accepting and finished (or cancelled) the requests
            await asyncio.to_thread(backend.close)

    # No redirect from /health/ to /health: Starlette builds the Location from the request's Host
    # header, which would send a client wherever that header says; an unknown path is a 404.
    app = FastAPI(title="minisgl", version=health.VERSION, lifespan=lifespan, redirect_slashes=False)
    app.state.server = state
    app.state.minisgl = backend
    app.state.limits = limits
    heap = app.state.heap = HeapTrimmer()

    def release_memory() -> None:
        # Once no request is in flight, what the last ones freed is free for good: give it back if
        # it amounts to something (the check reads /proc; the trim runs off the event loop).
        if heap.due():
            asyncio.get_running_loop().run_in_executor(None, heap.maybe_trim)

    # the server's stop (serve/server.py) waits on the requests it counts
    app.state.drain = Drain(on_idle=release_memory)
    app.add_middleware(DrainGuard, drain=app.state.drain)
    app.add_middleware(HostGuard, allowed=allowed_hosts)  # inside BodyGuard (the last added is outermost)
    app.state.buffered = Buffered()  # request body bytes held, over all requests
    app.add_middleware(BodyGuard, limits=limits, buffered=app.state.buffered)
    add_error_handlers(app)
    for router in (health, models, tokenizer, completions, chat):
        app.include_router(router.router)
    if enable_metrics:
        app.include_router(metrics.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented override
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the nested models of the request bodies the routes read themselves
    (serve/bodies.py: `documented_body`) moved into the components their references point to."""
    if app.openapi_schema is None:
        # a copy: the routes' openapi_extra dicts are shared by every app built from the routers
        schema = copy.deepcopy(get_openapi(title=app.title, version=app.version, routes=app.routes))
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path in schema["paths"].values():
            for op in path.values():
                body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
                components.update(body.get("schema", {}).pop("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema
