"""/v1/chat/completions: a conversation through the model's chat template, n samples, streamed or
not; tools (calls parsed out of the reply), response_format and vLLM's guided_* constraints."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request, Response

from minisgl_backend.chat import (
    ChatPrompt,
    GrammarProcessor,
    ToolCallStreamSplitter,
    guide_grammar,
    parse_tool_calls,
    partial_tool_call,
    render_chat,
)
from minisgl_backend.chat.logprobs import chat_logprobs
from minisgl_backend.chat.reasoning import ReasoningStreamSplitter, split_reasoning
from minisgl_backend.chat.tools import ParsedCall
from minisgl_backend.serve.backend import Stream
from minisgl_backend.serve.bodies import json_body
from minisgl_backend.serve.protocol import ChatCompletionRequest, NamedToolChoice
from minisgl_backend.serve.responses import (
    AssistantMessage,
    AssistantToolCall,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    DeltaToolCall,
    ToolCallFunction,
    Usage,
    UsageChunk,
)
from minisgl_backend.serve.state import AppState, ServerState, keyed_router
from minisgl_backend.serve.streams import (
    DONE,
    StreamMerger,
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


@generation_route(router, "/v1/chat/completions", ChatCompletionResponse, ChatCompletionRequest)
async def chat_completions(
    request: Request,
    state: AppState,
    body: Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))],
) -> Response:
    state.check_model(body.model)
    state.check_sequences(1, body.n)
    state.check_logprobs(body.top_logprobs, "top_logprobs")
    chars = sum(m.chars() for m in body.messages)  # tool calls' arguments too: the template renders them
    state.check_chars(chars, "the conversation", "messages")
    state.check_request_chars(chars, "the conversation", "messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = (
        body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    )
    guide = body.guide
    fmt = body.response_format.as_dict() if body.response_format is not None else None
    if guide is not None and guide.kind in ("json", "json_object"):
        fmt = guide.response_format()  # the response_format path: a forced call of a reply tool
        guide = None
    messages = [m.template_dict() for m in body.messages]
    pool = state.pool

    def prepare() -> ChatPrompt:
        if tools or fmt:  # the prompt shows them too: bound them before the template runs
            shown = len(json.dumps(tools, ensure_ascii=False)) + len(json.dumps(fmt, ensure_ascii=False))
            state.check_chars(chars + shown, "the conversation with its tools and format", "tools")
            state.check_request_chars(chars + shown, "the conversation with its tools and format", "tools")
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
    max_tokens = state.reply_budget(
        len(prompt.token_ids), body.max_completion_tokens or body.max_tokens, "the conversation"
    )
    params = body.to_sampling_params(max_tokens, state.backend.vocab_size, prompt.logits_processors)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await submit(state, [prompt.token_ids], [params], rid, body.user, body.stream)
    if body.stream:
        return sse_response(state, _stream(state, streams[0], body, rid, prompt), streams)
    (out,) = await results_or_disconnect(request, streams)

    def respond() -> str:
        choices = []
        for s in out.samples:  # one choice per sample (n)
            text, thought = split_reasoning(s.text) if state.reasoning else (s.text, None)
            content, calls, invalid = (
                parse_tool_calls(text, prompt.tool_names, prompt.reply_tool)
                if prompt.parses_output
                else (text, [], [])
            )
            tool_calls = _tool_calls(calls)
            content += _salvage(invalid, prompt.tool_names, tool_calls)
            finish = "tool_calls" if tool_calls and not invalid else s.finish_reason
            message = AssistantMessage(
                content=content if (content or not tool_calls) else None, tool_calls=tool_calls or None
            )
            if thought is not None:
                message = message.model_copy(update={"reasoning": thought})
            lps = _logprobs(state, s.logprobs or []) if body.logprobs else None
            choices.append(ChatChoice(index=s.index, message=message, logprobs=lps, finish_reason=finish))
        answer = ChatCompletionResponse(
            id=rid, created=int(time.time()), model=state.model_name, choices=choices, usage=Usage.of([out])
        )
        return answer.model_dump_json()

    return await json_answer(state, respond, body.n, body.logprobs)


async def _stream(
    state: ServerState, stream: Stream, body: ChatCompletionRequest, rid: str, prompt: ChatPrompt
) -> AsyncIterator[str]:
    created, model = int(time.time()), state.model_name
    # One splitter per choice (sample): each sample's text may hold its own tool call.
    splitters = [
        ToolCallStreamSplitter(prompt.reply_tool) if prompt.parses_output else None for _ in range(body.n)
    ]
    # With --reasoning-parser, a reply's leading trace is split off first; the rest is the answer.
    thinkers = [ReasoningStreamSplitter() if state.reasoning else None for _ in range(body.n)]

    def chunk(
        i: int, delta: ChatDelta, finish: str | None = None, logprobs: ChatLogprobs | None = None
    ) -> str:
        choice = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]))

    events = StreamMerger([stream], state.limits.stream_buffer_events * body.n)
    try:
        for i in range(body.n):
            yield chunk(i, ChatDelta(role="assistant", content=""))
        while True:
            _, item = await events.next()
            if isinstance(item, BaseException):
                yield sse_error(item)
                return
            if isinstance(item, StreamDelta):
                text, thinker = item.text, thinkers[item.index]
                if thinker is not None:
                    text, thought = thinker.feed(text)
                    if thought:
                        yield chunk(item.index, ChatDelta(reasoning=thought))
                splitter = splitters[item.index]
                text = splitter.feed(text) if splitter is not None else text
                # Each chunk carries the logprobs of the tokens it came with, as OpenAI streams
                # them (text held back for a stop string or a tool call still has its logprobs).
                lps = _logprobs(state, item.logprobs) if body.logprobs and item.logprobs else None
                if text or lps:
                    yield chunk(item.index, ChatDelta(content=text), logprobs=lps)
                continue
            out: RequestOutput = item
            for s in out.samples:
                finish: str = s.finish_reason
                splitter, thinker, held = splitters[s.index], thinkers[s.index], ""
                if thinker is not None:  # what it held back: a partial tag, or the rest of the trace
                    held, thought = thinker.finish()
                    if thought:
                        yield chunk(s.index, ChatDelta(reasoning=thought))
                if splitter is not None:
                    if held:
                        held = splitter.feed(held)
                    tail, calls, invalid = splitter.finish(prompt.tool_names)
                    tail = held + tail
                    tool_calls = _tool_calls(calls)
                    tail += _salvage(invalid, prompt.tool_names, tool_calls)
                    if tail:
                        yield chunk(s.index, ChatDelta(content=tail))
                    if tool_calls:
                        finish = "tool_calls" if not invalid else finish
                        deltas = [
                            DeltaToolCall(id=c.id, function=c.function, index=j)
                            for j, c in enumerate(tool_calls)
                        ]
                        yield chunk(s.index, ChatDelta(tool_calls=deltas))
                elif held:
                    yield chunk(s.index, ChatDelta(content=held))
                yield chunk(s.index, ChatDelta(), finish)
            break
        if body.include_usage:
            usage = Usage.of([out])
            yield sse(
                UsageChunk(id=rid, object="chat.completion.chunk", created=created, model=model, usage=usage)
            )
        yield DONE
    finally:
        stream.abort()
        events.close()


def _logprobs(state: ServerState, lps: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs.model_validate(chat_logprobs(state.token_text, lps))


def _tool_calls(calls: list[ParsedCall]) -> list[AssistantToolCall]:
    return [
        AssistantToolCall(
            id=c["id"],
            function=ToolCallFunction(name=c["name"], arguments=json.dumps(c["args"], ensure_ascii=False)),
        )
        for c in calls
    ]


def _salvage(invalid: list[ParsedCall], tool_names: set[str], calls: list[AssistantToolCall]) -> str:
    """What became of tagged calls that do not parse (a forced call cut by max_tokens): one that got
    as far as its arguments is appended to `calls` with the partial object written so far (closed
    into valid JSON); any other is returned as written, tags included, to go into the content: the
    tokens were generated and billed, so the client gets them rather than an empty reply."""
    text = []
    for bad in invalid:
        part = partial_tool_call(bad["args"], tool_names)
        if part is None:
            text.append(bad["text"])
        else:
            calls.append(AssistantToolCall(id=bad["id"], function=ToolCallFunction(**part)))
    return "".join(text)
