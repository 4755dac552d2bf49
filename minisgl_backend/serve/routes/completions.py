"""/v1/completions: one prompt or a batch (text or token ids), n samples each, streamed or not;
`echo` with `logprobs` and `max_tokens: 0` scores a prompt (lm-eval's loglikelihood over HTTP)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any

from fastapi import Depends, Request, Response

from minisgl_backend.chat import GrammarProcessor, guide_grammar
from minisgl_backend.chat.logprobs import TokenText
from minisgl_backend.serve.backend import Stream
from minisgl_backend.serve.bodies import json_body
from minisgl_backend.serve.protocol import CompletionRequest
from minisgl_backend.serve.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    UsageChunk,
)
from minisgl_backend.serve.state import AppState, ServerState, keyed_router
from minisgl_backend.serve.streams import (
    DONE,
    StreamMerger,
    abort_all,
    generation_route,
    json_answer,
    results_or_disconnect,
    sse,
    sse_error,
    sse_response,
    submit,
)
from minisgl_backend.types import RequestOutput, StreamDelta, TokenLogprob

router = keyed_router()


@generation_route(router, "/v1/completions", CompletionResponse, CompletionRequest)
async def completions(
    request: Request,
    state: AppState,
    body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
) -> Response:
    state.check_model(body.model)
    p = body.prompt
    prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    state.check_sequences(len(prompts), body.n)
    state.check_logprobs(body.logprobs, "logprobs")
    for i, pr in enumerate(prompts):
        what = "the prompt" if len(prompts) == 1 else f"prompt {i}"
        if isinstance(pr, str):
            state.check_chars(len(pr), what, "prompt")
        elif len(pr) > state.backend.max_model_len:
            state.reply_budget(len(pr), None, what)  # raises: longer than the context
    chars = sum(len(pr) for pr in prompts if isinstance(pr, str))
    state.check_request_chars(chars, "the request's prompts" if len(prompts) > 1 else "the prompt", "prompt")
    drop = body.max_tokens == 0  # echo-only scoring: the engine draws one token, which is dropped
    k = body.logprobs
    guide = body.guide
    echo = body.echo
    pool = state.pool

    def prepare() -> tuple[list[list[int]], list[str] | None, list[list[Callable[..., Any]]]]:
        tok = pool.tokenizer()
        texts = [pr for pr in prompts if isinstance(pr, str)]
        encoded = iter(tok(texts)["input_ids"] if texts else [])  # as Engine.submit encodes a string
        ids = [list(next(encoded)) if isinstance(pr, str) else list(pr) for pr in prompts]
        echo_text = [pr if isinstance(pr, str) else tok.decode(pr) for pr in prompts] if echo else None
        procs: list[list[Callable[..., Any]]] = [[] for _ in prompts]
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
            state.reply_budget(len(pr), 0, what)
            mt = 1
        elif explicit:
            mt = state.reply_budget(len(pr), body.max_tokens, what)
        else:  # OpenAI's default of 16, less where the context has no room for it
            mt = min(body.max_tokens or 16, state.reply_budget(len(pr), None, what))
        params.append(
            body.to_sampling_params(
                mt,
                state.backend.vocab_size,
                procs[i],
                prompt_logprobs=k if (echo and k is not None) else None,
            )
        )
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = await submit(state, ids, params, rid, body.user, body.stream)
    if body.stream:
        return sse_response(state, _stream(state, streams, body, rid, echo_text, drop), streams)
    outs = await results_or_disconnect(request, streams)

    def respond() -> str:
        token_text = state.token_text
        choices = []
        for i, out in enumerate(outs):
            prefix = echo_text[i] if echo_text else ""
            for s in out.samples:  # OpenAI's order: the n choices of prompt 0, then of prompt 1, ...
                lps = None
                if k is not None:
                    entries = _prompt_entries(out) if echo else []
                    generated = [] if drop else _generated_entries(s.logprobs)
                    lps = _logprobs(token_text, entries + generated, 0)[0]
                choices.append(
                    CompletionChoice(
                        index=i * body.n + s.index,
                        text=prefix + ("" if drop else s.text),
                        logprobs=lps,
                        finish_reason="length" if drop else s.finish_reason,
                    )
                )
        answer = CompletionResponse(
            id=rid,
            created=int(time.time()),
            model=state.model_name,
            choices=choices,
            usage=Usage.of(outs, drop),
        )
        return answer.model_dump_json()

    return await json_answer(state, respond, len(outs) * body.n, k is not None)


async def _stream(
    state: ServerState,
    streams: list[Stream],
    body: CompletionRequest,
    rid: str,
    echo_text: list[str] | None,
    drop: bool,
) -> AsyncIterator[str]:
    created, model, token_text = int(time.time()), state.model_name, state.token_text
    outs: dict[int, RequestOutput] = {}

    def chunk(
        i: int, text: str, finish: str | None = None, logprobs: CompletionLogprobs | None = None
    ) -> str:
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish)
        return sse(CompletionChunk(id=rid, created=created, model=model, choices=[choice]))

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
            lps, offset[i] = _logprobs(token_text, _generated_entries(delta.logprobs), offset[i])
        text = "" if drop else delta.text
        return chunk(i, text, logprobs=lps) if text or lps else None

    events = StreamMerger(streams, state.limits.stream_buffer_events * num_choices)
    try:
        if echo_text:
            for i, t in enumerate(echo_text):
                for j in range(n):
                    if hold[i * n + j] is None:
                        yield chunk(i * n + j, t)
        while len(outs) < len(streams):
            i, item = await events.next()
            if isinstance(item, BaseException):
                yield sse_error(item)
                return
            if isinstance(item, RequestOutput):
                outs[i] = item
                for s in item.samples:
                    c = i * n + s.index
                    held = hold[c]
                    if held is not None and echo_text is not None:
                        lps, offset[c] = _logprobs(token_text, _prompt_entries(item), 0)
                        yield chunk(c, echo_text[i], logprobs=lps)
                        for delta in held:
                            if (x := delta_chunk(c, delta)) is not None:
                                yield x
                    yield chunk(c, "", "length" if drop else s.finish_reason)
            else:
                c = i * n + item.index
                held = hold[c]
                if held is not None:
                    held.append(item)
                elif (x := delta_chunk(c, item)) is not None:
                    yield x
        if body.include_usage:
            usage = Usage.of([outs[i] for i in sorted(outs)], drop)
            yield sse(UsageChunk(id=rid, object="text_completion", created=created, model=model, usage=usage))
        yield DONE
    finally:  # the client went away (the response task was cancelled) or the stream ended
        abort_all(streams)
        events.close()


# ---------------------------------------------------------------------------------------------- logprobs
LogprobEntry = tuple[int, TokenLogprob | None]  # a token id and its logprob (None: it has none)


def _prompt_entries(out: RequestOutput) -> list[LogprobEntry]:
    plps: Sequence[TokenLogprob | None] = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return list(zip(out.prompt_token_ids, plps))


def _generated_entries(lps: Sequence[TokenLogprob] | None) -> list[LogprobEntry]:
    return [(lp.token_id, lp) for lp in lps or []]


def _top_dict(text: TokenText, lp: TokenLogprob) -> dict[str, float]:
    """top_logprobs of one position: the k most likely first (argmax included), then the token itself
    unless a more likely one already shows the same string."""
    d: dict[str, float] = {}
    for tid, v in lp.top:
        d.setdefault(text(tid), v)
    d.setdefault(text(lp.token_id), lp.logprob)
    return d


def _logprobs(
    text: TokenText, entries: Sequence[LogprobEntry], offset: int
) -> tuple[CompletionLogprobs, int]:
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
    lps = CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )
    return lps, offset
