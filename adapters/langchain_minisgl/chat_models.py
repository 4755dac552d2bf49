"""ChatMiniSGL: the engine as a LangChain chat model, with tool calling and constrained structured output."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, model_validator

from langchain_minisgl._base import (
    MiniSGLParams,
    await_handle,
    check_streamable,
    stream_async,
    stream_sync,
)
from langchain_minisgl._tools import ToolCallStreamSplitter, parse_tool_calls
from minisgl_backend import Engine, InvalidRequestError, RequestOutput, SamplingParams
from minisgl_backend.chat import ChatPrompt, forced_tools, render_chat
from minisgl_backend.chat.logprobs import TokenText, chat_logprobs
from minisgl_backend.chat.reasoning import ReasoningStreamSplitter, split_reasoning

_CALL_OPTIONS = ("tools", "tool_choice", "response_format", "stream", "logprobs", "top_logprobs")
# Content parts the model cannot read: an error names them instead of dropping them silently.
_MEDIA_PARTS = {"image", "image_url", "input_image", "audio", "input_audio", "video", "file"}


def _text(message: BaseMessage) -> str:
    if not isinstance(message.content, list):
        return str(message.content)
    media = sorted({str(p.get("type")) for p in message.content if isinstance(p, dict)} & _MEDIA_PARTS)
    if media:
        raise InvalidRequestError(
            f"ChatMiniSGL reads text only: a {message.type} message has {media} content part(s); "
            "send text parts (the model has no image or audio input)"
        )
    return message.text


def _to_openai(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message as an OpenAI-format dict (what the engine-level chat renderer takes)."""
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": _text(message)}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": _text(message)}
    if isinstance(message, AIMessage):
        calls = [
            {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["args"]}}
            for c in message.tool_calls
        ]
        return {"role": "assistant", "content": _text(message), **({"tool_calls": calls} if calls else {})}
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return {
            "role": "tool",
            "content": _text(message),
            "tool_call_id": getattr(message, "tool_call_id", None),
        }
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": _text(message)}
    raise TypeError(f"ChatMiniSGL cannot render a {type(message).__name__}")


class ChatMiniSGL(MiniSGLParams, BaseChatModel):
    """Chat on an in-process minisgl engine: chat-template rendering, streaming, tool calling.

    >>> chat = ChatMiniSGL(temperature=0, max_tokens=64)
    >>> chat.invoke("What is the capital of France?").content

    Forced tool calls (`bind_tools(..., tool_choice="any" | name)`) and `with_structured_output`
    constrain decoding to the schema, so the output always parses.
    """

    model_config = ConfigDict(protected_namespaces=())

    streaming: bool = False
    """Make invoke() stream internally (callbacks see every token)."""
    logprobs: bool = False
    """Return each output token's logprob in response_metadata["logprobs"] (OpenAI's shape)."""
    top_logprobs: int | None = None
    """With logprobs: how many alternatives per token (at most the engine's max_logprobs)."""
    reasoning: bool = False
    """Move a leading <think>...</think> (reasoning models, e.g. Qwen3) out of the content into
    additional_kwargs["reasoning_content"]."""

    @model_validator(mode="after")
    def _set_profile(self) -> ChatMiniSGL:
        # What LangChain reads before using a chat model. The context limit is known without
        # starting the engine only when configured (max_model_len); otherwise it is the model's.
        if self.profile is None:
            self.profile = {
                "tool_calling": True,
                "tool_choice": True,
                "structured_output": True,
                "image_inputs": False,
                "audio_inputs": False,
                "reasoning_output": self.reasoning,
                **({"max_input_tokens": n} if (n := self._config.max_model_len) else {}),
            }
        return self

    @property
    def _llm_type(self) -> str:
        return "minisgl-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="minisgl",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=self.sampling_value("temperature", kwargs),
            ls_max_tokens=self.sampling_value("max_tokens", kwargs),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        formatted = [convert_to_openai_tool(t) for t in tools]
        forced_tools(tool_choice, formatted)  # an unknown tool name fails here, not at the first call
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,  # decoding is always constrained: every method is strict
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        if kwargs:
            raise TypeError(f"unexpected argument(s) {sorted(kwargs)}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=name,
                ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
            )
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            # json_mode is constrained to the schema too: the parser below needs it, so any other
            # JSON object would only fail later.
            fmt = {"type": "json_schema", "json_schema": {"schema": convert_to_json_schema(schema)}}
            llm = self.bind(
                response_format=fmt,
                ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
            )
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(
                f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r}"
            )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # ------------------------------------------------------------------ request building
    def _prepare(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[Engine, list[int], SamplingParams, ChatPrompt]:
        """(engine, prompt ids, sampling params, the rendered prompt: what to parse out of the reply)."""
        self.check_call_kwargs(kwargs, _CALL_OPTIONS)
        engine = self.engine_for(kwargs)
        tok = engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                f"model {self.model_name!r} has no chat template; use MiniSGL (plain completion) instead"
            )
        prompt = render_chat(
            tok,
            [_to_openai(m) for m in messages],
            tools=kwargs.get("tools"),
            tool_choice=kwargs.get("tool_choice"),
            response_format=kwargs.get("response_format"),
        )
        params = self.sampling_params(stop, kwargs, prompt.logits_processors)
        if kwargs.get("logprobs", self.logprobs):
            k = kwargs.get("top_logprobs", self.top_logprobs)
            params = dataclasses.replace(params, logprobs=k or 0)
        return engine, prompt.token_ids, params, prompt

    def _message(self, out: RequestOutput, prompt: ChatPrompt, kwargs: dict[str, Any]) -> AIMessage:
        text, thought = split_reasoning(out.text) if self.reasoning else (out.text, None)
        content, calls, invalid = (
            parse_tool_calls(text, prompt.tool_names, prompt.reply_tool)
            if prompt.parses_output
            else (text, [], [])
        )
        if invalid and out.finish_reason == "length":
            invalid = [
                {**c, "error": f"{c['error']} (output cut at max_tokens={len(out.token_ids)})"}
                for c in invalid
            ]
        return AIMessage(
            content=content,
            tool_calls=calls,
            invalid_tool_calls=invalid,
            additional_kwargs={"reasoning_content": thought} if thought is not None else {},
            usage_metadata=self._usage(out),
            response_metadata=self._metadata(out, kwargs),
        )

    @staticmethod
    def _usage(out: RequestOutput) -> UsageMetadata:
        n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
        return UsageMetadata(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out)

    def _metadata(self, out: RequestOutput, kwargs: dict[str, Any]) -> dict[str, Any]:
        meta = {
            "model_name": kwargs.get("model") or self.model_name,
            "model_provider": "minisgl",
            "finish_reason": out.finish_reason,
            "seed": out.seed,
        }
        if out.logprobs is not None:
            meta["logprobs"] = chat_logprobs(TokenText(self.engine_for(kwargs).tokenizer), out.logprobs)
        return meta

    def _submitter(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        prepared: dict[str, Any],
    ) -> Callable[[Engine], list]:
        """Render and submit one conversation once the engine is known; the prompt lands in `prepared`."""

        def submit(engine: Engine) -> list:
            _, ids, params, prompt = self._prepare(messages, stop, kwargs)
            prepared["prompt"] = prompt
            return [engine.submit(ids, params)]

        return submit

    # ------------------------------------------------------------------ LangChain entry points
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prepared: dict[str, Any] = {}
        submit = self._submitter(messages, stop, kwargs, prepared)
        out = self.run_sync(kwargs, submit)[0]
        return self._chat_result(out, prepared["prompt"], kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prepared: dict[str, Any] = {}
        submit = self._submitter(messages, stop, kwargs, prepared)
        out = (await self.run_async(kwargs, submit))[0]
        return self._chat_result(out, prepared["prompt"], kwargs)

    def _chat_result(self, out: RequestOutput, prompt: ChatPrompt, kwargs: dict[str, Any]) -> ChatResult:
        """One generation per sample (n); invoke() returns the first, sample 0."""
        return ChatResult(
            generations=[ChatGeneration(message=self._message(s, prompt, kwargs)) for s in out.samples]
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # BaseChatModel.stream fires on_llm_new_token for every chunk yielded here.
        engine, ids, params, prompt = self._prepare(messages, stop, kwargs)
        check_streamable(params)
        handle = engine.submit(ids, params)
        splitter = ToolCallStreamSplitter(prompt.reply_tool) if prompt.parses_output else None
        thinker = ReasoningStreamSplitter() if self.reasoning else None
        for delta in stream_sync(engine, handle):
            if delta.finished:
                yield self._last_chunk(
                    delta.text, splitter, thinker, prompt.tool_names, handle.result(), kwargs
                )
            elif chunk := self._text_chunk(delta.text, splitter, thinker):
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        engine, ids, params, prompt = self._prepare(messages, stop, kwargs)
        check_streamable(params)
        handle = engine.submit(ids, params)
        splitter = ToolCallStreamSplitter(prompt.reply_tool) if prompt.parses_output else None
        thinker = ReasoningStreamSplitter() if self.reasoning else None
        async for delta in stream_async(engine, handle):
            if delta.finished:
                out = await await_handle(engine, handle)
                yield self._last_chunk(delta.text, splitter, thinker, prompt.tool_names, out, kwargs)
            elif chunk := self._text_chunk(delta.text, splitter, thinker):
                yield chunk

    @staticmethod
    def _text_chunk(
        text: str, splitter: ToolCallStreamSplitter | None, thinker: ReasoningStreamSplitter | None
    ) -> ChatGenerationChunk | None:
        thought = ""
        if thinker is not None:
            text, thought = thinker.feed(text)
        if splitter is not None:
            text = splitter.feed(text)
        if not text and not thought:
            return None
        extra = {"reasoning_content": thought} if thought else {}
        return ChatGenerationChunk(message=AIMessageChunk(content=text, additional_kwargs=extra))

    def _last_chunk(
        self,
        text: str,
        splitter: ToolCallStreamSplitter | None,
        thinker: ReasoningStreamSplitter | None,
        names: set[str],
        out: RequestOutput,
        kwargs: dict[str, Any],
    ) -> ChatGenerationChunk:
        thought = ""
        if thinker is not None:
            answer, thought = thinker.feed(text)
            rest_answer, rest_thought = thinker.finish()
            text, thought = answer + rest_answer, thought + rest_thought
        call_chunks = []
        if splitter is not None:
            splitter.feed(text)
            text, calls, invalid = splitter.finish(names)
            call_chunks = [
                tool_call_chunk(
                    name=c["name"], args=json.dumps(c["args"], ensure_ascii=False), id=c["id"], index=i
                )
                for i, c in enumerate(calls)
            ] + [
                tool_call_chunk(name=c["name"], args=c["args"], id=c["id"], index=len(calls) + i)
                for i, c in enumerate(invalid)
            ]
        message = AIMessageChunk(
            content=text,
            tool_call_chunks=call_chunks,
            additional_kwargs={"reasoning_content": thought} if thought else {},
            usage_metadata=self._usage(out),
            response_metadata=self._metadata(out, kwargs),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)

    def get_num_tokens(self, text: str) -> int:
        """Tokens of `text` under the engine's own tokenizer (the LangChain default downloads GPT-2's)."""
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def get_token_ids(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Exact prompt length: the conversation rendered with the chat template (and tool prompt)."""
        kwargs = {"tools": [convert_to_openai_tool(t) for t in tools]} if tools else {}
        return len(self._prepare(messages, None, kwargs)[1])
