"""How the server fails: OpenAI's error object, the one map from the engine's typed errors to HTTP
statuses, and the app's exception handlers (every failure a client sees is an `ErrorResponse`)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from minisgl_backend.chat import ChatTemplateError, GrammarError
from minisgl_backend.errors import (
    EmptyPromptError,
    EngineDeadError,
    EngineStalledError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
)
from minisgl_backend.serve.backend import ServerShuttingDownError
from minisgl_backend.serve.guard import BodyRejected

log = logging.getLogger("minisgl.serve")

RETRY_AFTER_S = 1
MAX_ERROR_CHARS = 500


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object (also the event that ends a stream which fails midway)."""

    error: ErrorInfo


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))


class APIError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


class SlowClientError(Exception):
    """A streaming client left more undelivered output than `stream_buffer_events` allows."""


class ClientGone(Exception):
    """The client went away before its non-streamed answer was ready: nobody reads the answer, which
    is an empty 499 (nginx's "client closed request") for the access log."""


# The one place where the engine's typed errors become HTTP statuses (most specific first).
ERROR_MAP: list[tuple[type[BaseException], int, str, str]] = [
    (PromptTooLongError, 400, "invalid_request_error", "context_length_exceeded"),
    (EmptyPromptError, 400, "invalid_request_error", "empty_prompt"),
    (InvalidSamplingParamsError, 400, "invalid_request_error", "invalid_sampling_params"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request"),
    (ChatTemplateError, 400, "invalid_request_error", "invalid_chat_request"),
    (GrammarError, 400, "invalid_request_error", "invalid_grammar"),
    (TemplateError, 400, "invalid_request_error", "invalid_chat_request"),
    (QueueFullError, 503, "server_overloaded", "queue_full"),
    (EngineDeadError, 503, "service_unavailable", "engine_dead"),
    (EngineStalledError, 503, "service_unavailable", "engine_dead"),
    (ServerShuttingDownError, 503, "service_unavailable", "shutting_down"),
    (SlowClientError, 408, "invalid_request_error", "client_too_slow"),
]


def api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BodyRejected):
        if exc.status == 503:
            headers = {"Connection": "close", "Retry-After": str(RETRY_AFTER_S)}
            return APIError(503, exc.message, "server_overloaded", code=exc.code, headers=headers)
        return APIError(exc.status, exc.message, code=exc.code, headers={"Connection": "close"})
    if isinstance(exc, RequestFailedError) and isinstance(exc.__cause__, GrammarError):
        exc = exc.__cause__  # the output left its grammar, or the parser hit its limits mid-way
    for cls, status, type_, code in ERROR_MAP:
        if isinstance(exc, cls):
            retry = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
            return APIError(status, first_line(str(exc)), type_, None, code, retry)
    # The detail goes to the log only: a client sees that something failed and the id to quote.
    incident = uuid.uuid4().hex[:16]
    log.error("internal error (request id %s)", incident, exc_info=exc)
    return APIError(
        500,
        f"internal server error (request id {incident}); the server log has the details",
        "internal_error",
        None,
        "internal_error",
        {"X-Request-Id": incident},
    )


def first_line(msg: str) -> str:
    """An error message for a client: its first line, at most MAX_ERROR_CHARS (a parser's state dump
    or a template's traceback stays in the log)."""
    line = msg.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request")
    first = errs[0]
    if first.get("type") == "json_invalid":
        return APIError(
            400,
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
            code="invalid_json",
        )
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errs]
    common: list[str] = []
    for parts in zip(*locs):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    msg = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        msg = f"unrecognized request argument supplied: {locs[0][-1] if locs[0] else '?'}"
    elif first.get("type") == "missing" and not locs[0]:
        msg = "the request body is missing"
    elif len(errs) > 1 and len(common) < len(locs[0]):  # a union: no accepted type matched
        msg = f"no accepted type matches ({'; '.join(sorted({e.get('msg', '') for e in errs}))})"
    where = ".".join(common if len(errs) > 1 else locs[0])
    return APIError(400, f"{where}: {msg}" if where else msg, param=where or None, code=first.get("type"))


class MappedRoute(APIRoute):
    """A route whose failures become OpenAI error objects (an unmapped one a generic 500), and whose
    client's leaving (ClientGone) an empty 499. Mapped here rather than in a handler for `Exception`:
    Starlette hands those to its server-error middleware, which answers and then re-raises them into
    the server's log as a crash."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def mapped(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except ClientGone:
                return PlainTextResponse("", status_code=499)
            except Exception as e:  # noqa: BLE001 - mapped to a status code
                raise api_error(e) from e

        return mapped


def _methods(req: Request) -> list[str]:
    """Every method some route of the app takes at the request's path."""
    return [
        m
        for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
        if any(r.matches({**req.scope, "method": m})[0] == Match.FULL for r in req.app.router.routes)
    ]


def add_error_handlers(app: FastAPI) -> None:
    """Every error a client sees is OpenAI's error object."""

    @app.exception_handler(APIError)
    async def api(_req: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(BodyRejected)
    async def body_rejected(_req: Request, exc: BodyRejected) -> JSONResponse:
        return api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names the methods of one route; a path may have several
            headers = {**(headers or {}), "Allow": ", ".join(_methods(req))}
        return APIError(exc.status_code, str(exc.detail), type_, headers=headers).response()

    @app.exception_handler(Exception)
    async def internal(_req: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()


# What /openapi.json shows for the failures every route may answer.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 415, 421, 431, 500, 503)
}
