"""The OpenAI-compatible HTTP API (FastAPI) over a `Backend` (serve/backend.py): one in-process
Engine, or engine replicas on Ray Serve behind this same app (serve/ray_app.py).

Every request is handed to the backend at once (`Engine.submit` never blocks), so concurrent HTTP
requests share the continuous batch. Results come back as `Stream`s the event loop awaits; a client
that goes away (mid-stream or while waiting for a non-streamed result) aborts its requests, so their
KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl_backend.chat import (
    ChatPrompt,
    ChatTemplateError,
    GrammarError,
    GrammarProcessor,
    ToolCallStreamSplitter,
    guide_grammar,
    parse_tool_calls,
    partial_tool_call,
    render_chat,
)
from minisgl_backend.chat.logprobs import TokenText, chat_logprobs
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
from minisgl_backend.serve.backend import Backend, ServerShuttingDownError, Stream, public_model_ref
from minisgl_backend.serve.guard import BodyGuard, BodyRejected, GuardedStreamingResponse, ServeLimits
from minisgl_backend.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from minisgl_backend.types import RequestOutput, SamplingParams, StreamDelta, TokenLogprob

log = logging.getLogger("minisgl.serve")

RETRY_AFTER_S = 1


# ---------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class SlowClientError(Exception):
    """A streaming client left more undelivered output than `stream_buffer_events` allows."""


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
        return APIError(exc.status, exc.message, code=exc.code, headers={"Connection": "close"})
    if isinstance(exc, RequestFailedError) and isinstance(exc.__cause__, GrammarError):
        exc = exc.__cause__  # the output left its grammar, or the parser hit its limits mid-way
    for cls, status, type_, code in ERROR_MAP:
        if isinstance(exc, cls):
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
            return APIError(status, _first_line(str(exc)), type_, None, code, headers)
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


MAX_ERROR_CHARS = 500


def _first_line(msg: str) -> str:
    """An error message for a client: its first line, at most MAX_ERROR_CHARS (a parser's state dump
    or a template's traceback stays in the log)."""
    line = msg.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def _validation_error(exc: RequestValidationError | ValidationError) -> APIError:
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


# ---------------------------------------------------------------------------------------------- state
class CPUPool:
    """The bounded executor for request-sized CPU work (JSON of large bodies, tokenising, chat
    templates, grammar compilation, detokenising): the event loop only does I/O. Each worker thread
    encodes with its own copy of the tokenizer (a fast tokenizer is not meant for concurrent use);
    the Rust encoder releases the GIL, so a long encode does not hold the loop up either."""

    def __init__(self, tokenizer: Any, workers: int) -> None:
        self._base = tokenizer
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="minisgl-serve-cpu")

    def tokenizer(self) -> Any:
        """This worker's tokenizer (call it on a worker thread)."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._lock:
                tok = self._local.tok = copy.deepcopy(self._base)
        return tok

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class ServerState:
    """What the routes share: the backend and the app's own settings."""

    backend: Backend
    model_name: str
    tokenizer: Any  # the event loop's own copy (the engine's may be encoding on other threads)
    api_key: str | None = None
    owns_backend: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    limits: ServeLimits = field(default_factory=ServeLimits)
    pool: CPUPool | None = None
    # The most characters one token stands for (the longest vocabulary entry): a text longer than
    # max_model_len times this cannot fit the context, whatever it tokenises to.
    max_token_chars: int = 1


# ---------------------------------------------------------------------------------------------- bodies
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


def _parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON -> checked text -> the request model; every failure is a 400 with OpenAI's error object."""
    if not raw:
        raise APIError(400, "the request body is missing", code="missing")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, an int of > 4300 digits, nesting
        raise APIError(
            400, f"the request body is not valid JSON: {_first_line(str(e))}", code="invalid_json"
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
        raise _validation_error(e) from None


# ---------------------------------------------------------------------------------------------- limits
def _context_error(msg: str, param: str | None = None) -> APIError:
    return APIError(400, msg, param=param, code="context_length_exceeded")


def _check_sequences(state: ServerState, prompts: int, n: int) -> None:
    lim = state.limits
    if prompts > lim.max_prompts:
        raise APIError(
            400,
            f"{prompts} prompts in one request; this server takes at most {lim.max_prompts} (--max-prompts)",
            param="prompt",
            code="too_many_prompts",
        )
    if prompts * n > lim.max_sequences:
        raise APIError(
            400,
            f"{prompts} prompts x n={n} = {prompts * n} sequences; this server takes at most "
            f"{lim.max_sequences} per request (--max-sequences)",
            param="n",
            code="too_many_sequences",
        )


def _check_chars(state: ServerState, chars: int, what: str, param: str) -> None:
    """The cheap bound before tokenising: more characters than max_model_len tokens can hold."""
    cap = state.backend.max_model_len * state.max_token_chars
    if chars > cap:
        raise _context_error(
            f"{what} has {chars} characters, more than max_model_len ({state.backend.max_model_len}) "
            f"tokens can hold (at most {state.max_token_chars} characters each)",
            param,
        )


def _room(state: ServerState, prompt_len: int, requested: int | None, what: str) -> int:
    """max_tokens for a prompt of `prompt_len` tokens: `requested` if it fits the context (else a 400,
    as vLLM), or all the room left when the client asked for no particular number."""
    limit = state.backend.max_model_len
    if prompt_len > limit:
        raise _context_error(
            f"the {what} has {prompt_len} tokens but the context limit (max_model_len) is {limit}"
        )
    if requested is None:
        if prompt_len >= limit:
            raise _context_error(
                f"the {what} has {prompt_len} tokens: no room for a reply in max_model_len ({limit})"
            )
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise _context_error(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the completion). "
            "Please reduce the length of the prompt or completion.",
            "max_tokens",
        )
    return requested


# ---------------------------------------------------------------------------------------------- streams in
async def _wait_disconnect(request: Request) -> None:
    """Returns once the client has gone away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _results_or_disconnect(request: Request, streams: Sequence[Stream]) -> list[RequestOutput]:
    """Every stream's result, unless the client goes away first: then the requests are aborted."""
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
        _abort(streams)  # no-op for finished ones


class _Merged:
    """(index, event) of several streams as they come; an error arrives as (index, exception).
    At most `limit` events wait for the client: past that its requests are aborted (their KV freed)
    and a SlowClientError is queued. `close()` is synchronous: it runs in `finally` blocks that a
    cancelled response may not await in."""

    def __init__(self, streams: Sequence[Stream], limit: int | None = None) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._streams, self._limit, self._overflowed = streams, limit, False
        self._tasks = [asyncio.ensure_future(self._forward(i, s)) for i, s in enumerate(streams)]

    async def _forward(self, i: int, s: Stream) -> None:
        try:
            async for ev in s.events():
                if self._overflowed:
                    return
                if self._limit is not None and self._queue.qsize() >= self._limit:
                    self._overflowed = True
                    _abort(self._streams)
                    self._queue.put_nowait(
                        (i, SlowClientError(f"the client left {self._limit} events unread: aborted"))
                    )
                    return
                self._queue.put_nowait((i, ev))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((i, e))

    async def next(self) -> tuple[int, Any]:
        return await self._queue.get()

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()


class ClientGone(Exception):
    pass


def _abort(streams: Sequence[Stream]) -> None:
    for s in streams:
        s.abort()


async def _submit(
    state: ServerState,
    prompts: Sequence[Any],
    params: Sequence[SamplingParams],
    prefix: str,
    user: str | None,
    stream: bool,
) -> list[Stream]:
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    return await state.backend.submit(prompts, params, ids, user, stream)


# ---------------------------------------------------------------------------------------------- helpers
def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _sampling(
    req: Any,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    processors: Sequence[Callable] = (),
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k is None else int(req.top_k),
        min_p=0.0 if req.min_p is None else float(req.min_p),
        seed=req.seed,
        max_tokens=max_tokens,
        stop=req.stops,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        logits_processors=tuple(processors),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        presence_penalty=float(req.presence_penalty),
        frequency_penalty=float(req.frequency_penalty),
        logit_bias=req.logit_bias_ids,
        n=req.n,
    )
    params.check_vocab(vocab_size)  # a 400 now rather than a failed request at its first draw
    return params


def _usage(outs: Sequence[RequestOutput], drop_generated: bool = False) -> dict[str, int]:
    """OpenAI's usage: each prompt once, the tokens of every sample (choice)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if drop_generated else sum(len(s.token_ids) for o in outs for s in o.samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_error(e: BaseException) -> str:
    """A failure in the middle of a stream: the status line is sent, so the error object is an event,
    and the stream still ends with `[DONE]`."""
    err = api_error(e)
    return _sse(error_body(err.message, err.type, None, err.code)) + "data: [DONE]\n\n"


def _top_dict(text: TokenText, lp: TokenLogprob) -> dict[str, float]:
    """top_logprobs of one position: the k most likely first (argmax included), then the token itself
    unless a more likely one already shows the same string."""
    d: dict[str, float] = {}
    for tid, v in lp.top:
        d.setdefault(text(tid), v)
    d.setdefault(text(lp.token_id), lp.logprob)
    return d


LogprobEntry = tuple[int, TokenLogprob | None]  # a token id and its logprob (None: it has none)


def _prompt_entries(out: RequestOutput) -> list[LogprobEntry]:
    plps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return list(zip(out.prompt_token_ids, plps))


def _generated_entries(lps: Sequence[TokenLogprob] | None) -> list[LogprobEntry]:
    return [(lp.token_id, lp) for lp in lps or []]


def _text_logprobs(
    text: TokenText, entries: Sequence[LogprobEntry], offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI's completion logprobs object for these tokens, the first at character `offset` of the
    choice's text; and the offset after the last (where a streamed choice's next chunk starts)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, lp in entries:
        s = text(tid)
        tokens.append(s)
        token_logprobs.append(None if lp is None else lp.logprob)
        top.append(None if lp is None else _top_dict(text, lp))
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }, offset


def _openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)},
        }
        for c in calls
    ]


# ---------------------------------------------------------------------------------------------- app
def _mapped(route: Callable) -> Callable:
    """A route whose failures become OpenAI error objects (an unmapped one a generic 500)."""

    @functools.wraps(route)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await route(*args, **kwargs)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            raise api_error(e) from e

    return wrapper


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("minisgl")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


_VERSION = _package_version()


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def build_app(
    backend: Backend,
    model_name: str | None = None,
    api_key: str | None = None,
    owns_backend: bool = False,
    enable_metrics: bool = True,
    limits: ServeLimits | None = None,
) -> FastAPI:
    """The API over `backend`. `owns_backend`: close it when the app shuts down (the CLI's case).
    `limits`: the per-request bounds (ServeLimits' defaults unless given).
    `app.state.minisgl` is the backend (tests and the runner reach the engine side through it)."""
    from contextlib import asynccontextmanager

    limits = limits or ServeLimits()
    tokenizer = copy.deepcopy(backend.tokenizer)
    state = ServerState(
        backend=backend,
        model_name=model_name or public_model_ref(backend.model_ref),
        api_key=api_key,
        owns_backend=owns_backend,
        tokenizer=tokenizer,
        limits=limits,
        pool=CPUPool(backend.tokenizer, limits.cpu_workers),
        max_token_chars=max(1, max(map(len, tokenizer.get_vocab()), default=1)),
    )
    pool = state.pool
    token_text = TokenText(state.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.close()
        if state.owns_backend:  # uvicorn has stopped accepting and finished (or cancelled) the requests
            await asyncio.to_thread(backend.close)

    app = FastAPI(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.minisgl = backend
    app.state.limits = limits
    app.add_middleware(BodyGuard, limits=limits)

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(BodyRejected)
    async def _body_rejected(_req: Request, exc: BodyRejected) -> JSONResponse:
        return api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), type_, None, None),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    async def auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != state.api_key:
            raise APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    guarded = [Depends(auth)]

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        if len(raw) <= SMALL_BODY:
            return _parse_body(raw, model)
        return await pool.run(_parse_body, raw, model)

    # ------------------------------------------------------------------ info endpoints
    async def health() -> Any:
        why = await backend.unhealthy()
        if why is not None:
            return JSONResponse(
                error_body(why, "service_unavailable", None, "engine_dead"),
                status_code=503,
            )
        return {"status": "ok"}

    app.get("/health")(health)
    app.api_route("/ping", methods=["GET", "POST"])(health)  # vLLM's (SageMaker's) name for it

    @app.get("/version")
    async def version() -> Any:
        return {"version": _VERSION}

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> Any:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "minisgl",
                    "root": public_model_ref(backend.model_ref),
                    "parent": None,
                    "max_model_len": backend.max_model_len,
                }
            ],
        }

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def model_info(model_id: str) -> Any:
        _check_model(state, model_id)
        return (await models())["data"][0]

    @app.get("/tokenizer_info", dependencies=guarded)
    async def tokenizer_info() -> Any:
        tok = state.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "eos_token_id": tok.eos_token_id,
            "bos_token_id": tok.bos_token_id,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": backend.max_model_len,
            "vocab_size": backend.vocab_size,
            "add_bos_token": getattr(tok, "add_bos_token", None),
        }

    @app.post("/tokenize", dependencies=guarded)
    @_mapped
    async def tokenize(request: Request) -> Any:
        body: TokenizeRequest = await parse(request, TokenizeRequest)
        _check_model(state, body.model)
        messages = [_message_dict(m) for m in body.messages] if body.messages is not None else None

        def work() -> bytes:  # on a worker: long texts are what /tokenize is for (lm-eval's rolling windows)
            tok = pool.tokenizer()
            if messages is not None:
                ids = render_chat(
                    tok,
                    messages,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    template_kwargs=body.chat_template_kwargs,
                ).token_ids
            else:
                ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
            return _json_bytes(
                {
                    "count": len(ids),
                    "max_model_len": backend.max_model_len,
                    "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
                }
            )

        return Response(await pool.run(work), media_type="application/json")

    @app.post("/detokenize", dependencies=guarded)
    @_mapped
    async def detokenize(request: Request) -> Any:
        body: DetokenizeRequest = await parse(request, DetokenizeRequest)
        _check_model(state, body.model)

        def work() -> bytes:
            bad = [t for t in body.tokens if not 0 <= t < backend.vocab_size]
            if bad:
                raise APIError(
                    400, f"token ids out of range [0, {backend.vocab_size}): {bad[:5]}", param="tokens"
                )
            return _json_bytes({"prompt": pool.tokenizer().decode(body.tokens)})

        return Response(await pool.run(work), media_type="application/json")

    if enable_metrics:

        @app.get("/metrics", dependencies=guarded)
        async def metrics() -> Any:
            body, ctype = await backend.render_metrics()
            return PlainTextResponse(body, media_type=ctype)

    def streaming(content: AsyncIterator[str], streams: Sequence[Stream]) -> GuardedStreamingResponse:
        return GuardedStreamingResponse(
            content,
            limits.stream_idle_timeout_s,
            on_close=lambda: _abort(streams),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions", dependencies=guarded)
    @_mapped
    async def completions(request: Request) -> Any:
        body: CompletionRequest = await parse(request, CompletionRequest)
        _check_model(state, body.model)
        p = body.prompt
        prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        _check_sequences(state, len(prompts), body.n)
        for i, pr in enumerate(prompts):
            what = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            if isinstance(pr, str):
                _check_chars(state, len(pr), what, "prompt")
            elif len(pr) > backend.max_model_len:
                _room(state, len(pr), None, what)  # raises: longer than the context
        drop = body.max_tokens == 0  # echo-only scoring: the engine draws one token, which is dropped
        k = body.logprobs
        guide = body.guide
        echo = body.echo

        def prepare() -> tuple[list[list[int]], list[str] | None, list[list[Callable]]]:
            tok = pool.tokenizer()
            texts = [pr for pr in prompts if isinstance(pr, str)]
            encoded = iter(tok(texts)["input_ids"] if texts else [])  # as Engine.submit encodes a string
            ids = [list(next(encoded)) if isinstance(pr, str) else list(pr) for pr in prompts]
            echo_text = [pr if isinstance(pr, str) else tok.decode(pr) for pr in prompts] if echo else None
            procs: list[list[Callable]] = [[] for _ in prompts]
            if guide is not None:  # one processor per prompt (each holds its parser's state)
                grammar = guide_grammar(guide.kind, guide.value)
                procs = [[GrammarProcessor(tok, grammar)] for _ in prompts]
            return ids, echo_text, procs

        ids, echo_text, procs = await pool.run(prepare)
        explicit = "max_tokens" in body.model_fields_set
        params = []
        for i, pr in enumerate(ids):
            what = "prompt" if len(ids) == 1 else f"prompt {i}"
            if drop:
                _room(state, len(pr), 0, what)
                mt = 1
            elif explicit:
                mt = _room(state, len(pr), body.max_tokens, what)
            else:  # OpenAI's default of 16, less where the context has no room for it
                mt = min(body.max_tokens or 16, _room(state, len(pr), None, what))
            params.append(
                _sampling(
                    body,
                    mt,
                    k,
                    backend.vocab_size,
                    procs[i],
                    prompt_logprobs=k if (echo and k is not None) else None,
                )
            )
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, ids, params, rid, body.user, body.stream)
        model = state.model_name
        if body.stream:
            return streaming(
                _stream_completion(state, streams, body, rid, echo_text, drop, token_text), streams
            )
        try:
            outs = await _results_or_disconnect(request, streams)
        except ClientGone:
            return PlainTextResponse("", status_code=499)

        def respond() -> bytes:
            choices = []
            for i, out in enumerate(outs):
                prefix = echo_text[i] if echo_text else ""
                for s in out.samples:  # OpenAI's order: the n choices of prompt 0, then of prompt 1, ...
                    lps = None
                    if k is not None:
                        entries = _prompt_entries(out) if echo else []
                        generated = [] if drop else _generated_entries(s.logprobs)
                        lps = _text_logprobs(token_text, entries + generated, 0)[0]
                    choices.append(
                        {
                            "index": i * body.n + s.index,
                            "text": prefix + ("" if drop else s.text),
                            "finish_reason": "length" if drop else s.finish_reason,
                            "logprobs": lps,
                        }
                    )
            return _json_bytes(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": choices,
                    "usage": _usage(outs, drop),
                    "system_fingerprint": None,
                }
            )

        small = len(outs) * body.n <= 8 and k is None
        return Response(respond() if small else await pool.run(respond), media_type="application/json")

    # ------------------------------------------------------------------ chat completions
    @app.post("/v1/chat/completions", dependencies=guarded)
    @_mapped
    async def chat_completions(request: Request) -> Any:
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        _check_model(state, body.model)
        _check_sequences(state, 1, body.n)
        chars = sum(len(m.text()) for m in body.messages)
        _check_chars(state, chars, "the conversation", "messages")
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = (
            body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        )
        guide = body.guide
        fmt = body.response_format.as_dict() if body.response_format is not None else None
        if guide is not None and guide.kind in ("json", "json_object"):
            fmt = guide.response_format()  # the response_format path: a forced call of a reply tool
            guide = None
        messages = [_message_dict(m) for m in body.messages]

        def prepare() -> ChatPrompt:
            if tools or fmt:  # the prompt shows them too: bound them before the template runs
                shown = len(json.dumps(tools, ensure_ascii=False)) + len(json.dumps(fmt, ensure_ascii=False))
                _check_chars(state, chars + shown, "the conversation with its tools and format", "tools")
            tok = pool.tokenizer()
            prompt = render_chat(
                tok,
                messages,
                tools=tools,
                tool_choice=choice,
                response_format=fmt,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
            )
            if guide is not None:  # a bare grammar over the whole reply (regex, choice, Lark)
                prompt.logits_processors.append(GrammarProcessor(tok, guide_grammar(guide.kind, guide.value)))
            return prompt

        prompt = await pool.run(prepare)
        max_tokens = _room(
            state, len(prompt.token_ids), body.max_completion_tokens or body.max_tokens, "messages"
        )
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling(body, max_tokens, k, backend.vocab_size, prompt.logits_processors)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, [prompt.token_ids], [params], rid, body.user, body.stream)
        if body.stream:
            return streaming(_stream_chat(state, streams[0], body, rid, prompt, token_text), streams)
        try:
            (out,) = await _results_or_disconnect(request, streams)
        except ClientGone:
            return PlainTextResponse("", status_code=499)
        choices = []
        for s in out.samples:  # one choice per sample (n)
            content, calls, invalid = (
                parse_tool_calls(s.text, prompt.tool_names, prompt.reply_tool)
                if prompt.parses_output
                else (s.text, [], [])
            )
            openai_calls = _openai_calls(calls)
            content += _salvage(invalid, prompt.tool_names, openai_calls)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content if (content or not openai_calls) else None,
            }
            finish = s.finish_reason
            if openai_calls:
                message["tool_calls"] = openai_calls
                finish = "tool_calls" if not invalid else finish
            choices.append(
                {
                    "index": s.index,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": chat_logprobs(token_text, s.logprobs or []) if body.logprobs else None,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": state.model_name,
                "choices": choices,
                "usage": _usage([out]),
                "system_fingerprint": None,
            }
        )

    return app


def _salvage(invalid: list[dict[str, Any]], tool_names: set[str], calls: list[dict[str, Any]]) -> str:
    """What became of tagged calls that do not parse (a forced call cut by max_tokens): one that got
    as far as its arguments is appended to `calls` with the arguments as written so far (not valid
    JSON, as OpenAI returns a cut call); the text of any other is returned, to go into the content."""
    text = []
    for bad in invalid:
        part = partial_tool_call(bad["args"], tool_names)
        if part is None:
            text.append(bad["args"])
        else:
            calls.append({"id": bad["id"], "type": "function", "function": part})
    return "".join(text)


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in m.tool_calls
        ]
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
    return d


# ---------------------------------------------------------------------------------------------- streams
async def _stream_completion(
    state: ServerState,
    streams: list[Stream],
    body: CompletionRequest,
    rid: str,
    echo_text: list[str] | None,
    drop: bool,
    token_text: TokenText,
) -> AsyncIterator[str]:
    created, model = int(time.time()), state.model_name
    outs: dict[int, RequestOutput] = {}

    def chunk(i: int, text: str, finish: str | None = None, logprobs: Any = None) -> str:
        return _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            }
        )

    # Each chunk carries the logprobs of the tokens it came with (held-back text included), at
    # their offsets in the choice's text. With echo, the prompt's logprobs come only with the
    # finished result, so such a choice is held back until then: its echo must come first.
    k = body.logprobs
    n = body.n  # choice index = prompt index * n + sample index
    num_choices = len(streams) * n
    hold: list[list[StreamDelta] | None] = [
        [] if echo_text and k is not None else None for _ in range(num_choices)
    ]
    offset = [0] * num_choices

    def delta_chunk(i: int, delta: StreamDelta) -> str | None:
        lps = None
        if k is not None and delta.logprobs and not drop:
            lps, offset[i] = _text_logprobs(token_text, _generated_entries(delta.logprobs), offset[i])
        text = "" if drop else delta.text
        return chunk(i, text, logprobs=lps) if text or lps else None

    events = _Merged(streams, state.limits.stream_buffer_events * num_choices)
    try:
        if echo_text:
            for i, t in enumerate(echo_text):
                for j in range(n):
                    if hold[i * n + j] is None:
                        yield chunk(i * n + j, t)
        while len(outs) < len(streams):
            i, item = await events.next()
            if isinstance(item, BaseException):
                yield _sse_error(item)
                return
            if isinstance(item, RequestOutput):
                outs[i] = item
                for s in item.samples:
                    c = i * n + s.index
                    if hold[c] is not None:
                        lps, offset[c] = _text_logprobs(token_text, _prompt_entries(item), 0)
                        yield chunk(c, echo_text[i], logprobs=lps)
                        for delta in hold[c]:
                            if (x := delta_chunk(c, delta)) is not None:
                                yield x
                    yield chunk(c, "", "length" if drop else s.finish_reason)
            else:
                c = i * n + item.index
                if hold[c] is not None:
                    hold[c].append(item)
                elif (x := delta_chunk(c, item)) is not None:
                    yield x
        if body.include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": _usage([outs[i] for i in sorted(outs)], drop),
                }
            )
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the response task was cancelled) or the stream ended
        _abort(streams)
        events.close()


async def _stream_chat(
    state: ServerState,
    stream: Stream,
    body: ChatCompletionRequest,
    rid: str,
    prompt: ChatPrompt,
    token_text: TokenText,
) -> AsyncIterator[str]:
    created, model = int(time.time()), state.model_name
    # One splitter per choice (sample): each sample's text may hold its own tool call.
    splitters = [
        ToolCallStreamSplitter(prompt.reply_tool) if prompt.parses_output else None for _ in range(body.n)
    ]

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        return _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": None,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            }
        )

    events = _Merged([stream], state.limits.stream_buffer_events * body.n)
    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        while True:
            _, item = await events.next()
            if isinstance(item, BaseException):
                yield _sse_error(item)
                return
            if isinstance(item, StreamDelta):
                splitter = splitters[item.index]
                text = splitter.feed(item.text) if splitter is not None else item.text
                # Each chunk carries the logprobs of the tokens it came with, as OpenAI streams
                # them (text held back for a stop string or a tool call still has its logprobs).
                lps = chat_logprobs(token_text, item.logprobs) if body.logprobs and item.logprobs else None
                if text or lps:
                    yield chunk(item.index, {"content": text}, logprobs=lps)
                continue
            out: RequestOutput = item
            for s in out.samples:
                finish: str = s.finish_reason
                splitter = splitters[s.index]
                if splitter is not None:
                    tail, calls, invalid = splitter.finish(prompt.tool_names)
                    openai_calls = _openai_calls(calls)
                    tail += _salvage(invalid, prompt.tool_names, openai_calls)
                    if tail:
                        yield chunk(s.index, {"content": tail})
                    if openai_calls:
                        finish = "tool_calls" if not invalid else finish
                        yield chunk(
                            s.index,
                            {"tool_calls": [{**c, "index": j} for j, c in enumerate(openai_calls)]},
                        )
                yield chunk(s.index, {}, finish)
            break
        if body.include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": _usage([out]),
                }
            )
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()
        events.close()
