"""Request bodies: JSON -> checked text -> the route's request model, every failure a 400 with
OpenAI's error object. The routes read their bodies themselves (`json_body`) rather than through
FastAPI: a large body is parsed on a worker thread, and JSON's escapes are checked for text that
is not UTF-8 and nesting that would exhaust the stack. Their schemas reach /openapi.json through
`documented_body`."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from minisgl_backend.serve.errors import APIError, first_line, validation_error
from minisgl_backend.serve.state import AppState

M = TypeVar("M", bound=BaseModel)

SMALL_BODY = 64 * 1024  # bodies up to this are parsed on the loop (cheaper than the hop to a worker)
MAX_JSON_DEPTH = 64


def _bad_text(obj: Any) -> str | None:
    """Where (a dotted path) the parsed JSON holds a string that is not encodable UTF-8 (a lone
    surrogate such as "\\ud800", which JSON's escapes allow), or None. Raises APIError for nesting
    deeper than MAX_JSON_DEPTH."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        o, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(
                400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="too_deep"
            )
        if isinstance(o, str):
            if not o.isascii():
                try:
                    o.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(o, dict):
            for k, v in o.items():
                p = f"{path}.{k}" if path else str(k)
                if not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return path or "body"
                if isinstance(v, (dict, list)) or (isinstance(v, str) and not v.isascii()):
                    stack.append((v, p, depth + 1))
        elif isinstance(o, list):
            for i, v in enumerate(o):
                if isinstance(v, (dict, list)) or (isinstance(v, str) and not v.isascii()):
                    stack.append((v, f"{path}.{i}" if path else str(i), depth + 1))
    return None


def parse_body(raw: bytes, model: type[M]) -> M:
    if not raw:
        raise APIError(400, "the request body is missing", code="missing")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, an int of > 4300 digits, nesting
        raise APIError(
            400, f"the request body is not valid JSON: {first_line(str(e))}", code="invalid_json"
        ) from None
    where = _bad_text(obj)
    if where is not None:
        raise APIError(
            400,
            f"{where}: not valid Unicode text (a lone surrogate such as \\ud800); send well-formed UTF-8",
            param=where,
            code="invalid_unicode",
        )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


def check_json_type(content_type: str | None) -> None:
    """A 415 unless the body says it is JSON (`application/json`, parameters such as a charset
    allowed). A web page can POST `text/plain`, a form or a typeless blob to this server without
    the browser asking first (no CORS preflight), which would let any site a user visits run
    generations on a local server; it cannot send `application/json` that way. A missing type is
    refused too: a browser's `fetch` of a bare blob sends none, and every OpenAI client sends one."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise APIError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json' (got {got})",
            param="Content-Type",
            code="unsupported_media_type",
        )


def json_body(model: type[M]) -> Callable[[Request, AppState], Awaitable[M]]:
    """A dependency that hands a route its body as `model` (a 415 unless it is sent as JSON)."""

    async def read(request: Request, state: AppState) -> M:
        check_json_type(request.headers.get("content-type"))
        raw = await request.body()
        if len(raw) <= SMALL_BODY:
            return parse_body(raw, model)
        return await state.pool.run(parse_body, raw, model)

    return read


def documented_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: `model` as its JSON body. Nested models are referenced from the
    document's components (the app's `openapi()` moves this schema's `$defs` there)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
