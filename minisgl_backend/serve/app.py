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
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl_backend.chat import (
    ChatPrompt,
    ChatTemplateError,
    GrammarError,
    ToolCallStreamSplitter,
    parse_tool_calls,
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
)
from minisgl_backend.serve.backend import Backend, ServerShuttingDownError, Stream
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


# The one place where the engine's typed errors become HTTP statuses (most specific first).
ERROR_MAP: list[tuple[type[BaseException], int, str, str]] = [
    (PromptTooLongError, 400, "invalid_request_error", "context_length_exceeded"),
    (EmptyPromptError, 400, "invalid_request_error", "empty_prompt"),
    (InvalidSamplingParamsError, 400, "invalid_request_error", "invalid_sampling_params"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request"),
    (ChatTemplateError, 400, "invalid_request_error", "invalid_chat_request"),
    (GrammarError, 400, "invalid_request_error", "invalid_grammar"),
    (QueueFullError, 503, "server_overloaded", "queue_full"),
    (EngineDeadError, 503, "service_unavailable", "engine_dead"),
    (EngineStalledError, 503, "service_unavailable", "engine_dead"),
    (ServerShuttingDownError, 503, "service_unavailable", "shutting_down"),
]


def api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    for cls, status, type_, code in ERROR_MAP:
        if isinstance(exc, cls):
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
            return APIError(status, str(exc), type_, None, code, headers)
    log.exception("internal error", exc_info=exc)
    return APIError(
        500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", None, "internal_error"
    )


def _validation_error(exc: RequestValidationError) -> APIError:
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
@dataclass
class ServerState:
    """What the routes share: the backend and the app's own settings."""

    backend: Backend
    model_name: str
    tokenizer: Any  # the event loop's own copy (the engine's may be encoding on other threads)
    api_key: str | None = None
    owns_backend: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


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
    `close()` is synchronous: it runs in `finally` blocks that a cancelled response may not await in."""

    def __init__(self, streams: Sequence[Stream]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._forward(i, s)) for i, s in enumerate(streams)]

    async def _forward(self, i: int, s: Stream) -> None:
        try:
            async for ev in s.events():
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
    """A failure in the middle of a stream: the status line is sent, so the error object is an event."""
    err = api_error(e)
    return _sse(error_body(err.message, err.type, None, err.code))


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
def build_app(
    backend: Backend,
    model_name: str | None = None,
    api_key: str | None = None,
    owns_backend: bool = False,
    enable_metrics: bool = True,
) -> FastAPI:
    """The API over `backend`. `owns_backend`: close it when the app shuts down (the CLI's case).
    `app.state.minisgl` is the backend (tests and the runner reach the engine side through it)."""
    from contextlib import asynccontextmanager

    state = ServerState(
        backend=backend,
        model_name=model_name or backend.model_ref,
        api_key=api_key,
        owns_backend=owns_backend,
        tokenizer=copy.deepcopy(backend.tokenizer),
    )
    token_text = TokenText(state.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if state.owns_backend:  # uvicorn has stopped accepting and finished (or cancelled) the requests
            await asyncio.to_thread(backend.close)

    app = FastAPI(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.minisgl = backend

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return exc.response()

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

    # ------------------------------------------------------------------ info endpoints
    @app.get("/health")
    async def health() -> Any:
        why = await backend.unhealthy()
        if why is not None:
            return JSONResponse(
                error_body(why, "service_unavailable", None, "engine_dead"),
                status_code=503,
            )
        return {"status": "ok"}

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
                    "root": backend.model_dir,
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
    async def tokenize(body: TokenizeRequest) -> Any:
        _check_model(state, body.model)
        tok = state.tokenizer
        if body.messages is not None:
            prompt = render_chat(
                tok,
                [_message_dict(m) for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
            )
            ids = prompt.token_ids
        else:
            ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {
            "count": len(ids),
            "max_model_len": backend.max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest) -> Any:
        _check_model(state, body.model)
        bad = [t for t in body.tokens if not 0 <= t < backend.vocab_size]
        if bad:
            raise APIError(
                400, f"token ids out of range [0, {backend.vocab_size}): {bad[:5]}", param="tokens"
            )
        return {"prompt": state.tokenizer.decode(body.tokens)}

    if enable_metrics:

        @app.get("/metrics", dependencies=guarded)
        async def metrics() -> Any:
            body, ctype = await backend.render_metrics()
            return PlainTextResponse(body, media_type=ctype)

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        p = body.prompt
        prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        drop = body.max_tokens == 0  # echo-only scoring: the engine draws one token, which is dropped
        k = body.logprobs
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            params = _sampling(
                body,
                max(1, body.max_tokens or 0),
                k,
                backend.vocab_size,
                prompt_logprobs=k if (body.echo and k is not None) else None,
            )
            streams = await _submit(state, prompts, [params] * len(prompts), rid, body.user, body.stream)
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            raise api_error(e) from e
        echo_text = (
            [pr if isinstance(pr, str) else state.tokenizer.decode(pr) for pr in prompts]
            if body.echo
            else None
        )
        model = state.model_name
        if body.stream:
            return StreamingResponse(
                _stream_completion(state, streams, body, rid, echo_text, drop, token_text),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            outs = await _results_or_disconnect(request, streams)
        except ClientGone:
            return PlainTextResponse("", status_code=499)
        except Exception as e:  # noqa: BLE001
            raise api_error(e) from e
        choices = []
        for i, out in enumerate(outs):
            prefix = echo_text[i] if echo_text else ""
            for s in out.samples:  # OpenAI's order: the n choices of prompt 0, then of prompt 1, ...
                lps = None
                if k is not None:
                    entries = _prompt_entries(out) if body.echo else []
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
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": _usage(outs, drop),
            "system_fingerprint": None,
        }

    # ------------------------------------------------------------------ chat completions
    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = (
            body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        )
        fmt = body.response_format.as_dict() if body.response_format is not None else None
        try:
            prompt = render_chat(
                state.tokenizer,
                [_message_dict(m) for m in body.messages],
                tools=tools,
                tool_choice=choice,
                response_format=fmt,
            )
            max_tokens = (
                body.max_completion_tokens
                or body.max_tokens
                or max(1, backend.max_model_len - len(prompt.token_ids))
            )
            k = (body.top_logprobs or 0) if body.logprobs else None
            params = _sampling(body, max_tokens, k, backend.vocab_size, prompt.logits_processors)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            streams = await _submit(state, [prompt.token_ids], [params], rid, body.user, body.stream)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            raise api_error(e) from e
        if body.stream:
            return StreamingResponse(
                _stream_chat(state, streams[0], body, rid, prompt, token_text),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            (out,) = await _results_or_disconnect(request, streams)
        except ClientGone:
            return PlainTextResponse("", status_code=499)
        except Exception as e:  # noqa: BLE001
            raise api_error(e) from e
        choices = []
        for s in out.samples:  # one choice per sample (n)
            content, calls, _invalid = (
                parse_tool_calls(s.text, prompt.tool_names, prompt.reply_tool)
                if prompt.parses_output
                else (s.text, [], [])
            )
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content if (content or not calls) else None,
            }
            finish = s.finish_reason
            if calls:
                message["tool_calls"] = _openai_calls(calls)
                finish = "tool_calls"
            choices.append(
                {
                    "index": s.index,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": chat_logprobs(token_text, s.logprobs or []) if body.logprobs else None,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": _usage([out]),
            "system_fingerprint": None,
        }

    return app


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

    try:
        events = _Merged(streams)
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

    try:
        events = _Merged([stream])
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
                    tail, calls, _invalid = splitter.finish(prompt.tool_names)
                    if tail:
                        yield chunk(s.index, {"content": tail})
                    if calls:
                        finish = "tool_calls"
                        yield chunk(
                            s.index,
                            {"tool_calls": [{**c, "index": j} for j, c in enumerate(_openai_calls(calls))]},
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
