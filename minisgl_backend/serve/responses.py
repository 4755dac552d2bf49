"""Response models of the OpenAI-compatible API: what each route answers, as /openapi.json shows it.

The JSON is what OpenAI's clients (and lm-eval's) parse, so null and absent differ on purpose: a
field OpenAI always sends is null when empty, one it sends only when it applies (`usage` in stream
chunks, a message's `tool_calls`, the keys of a stream delta) is `Omitted`. Floats that are not
finite are written as JSON's usual extension (-Infinity), as `json.dumps` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minisgl_backend.types import RequestOutput


def _is_none(value: Any) -> bool:
    return value is None


def Omitted() -> Any:  # noqa: N802 - reads as a field type's default
    """A field left out of the JSON while it is None."""
    return Field(None, exclude_if=_is_none)


class _Response(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="constants")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, outs: Sequence[RequestOutput], drop_generated: bool = False) -> Usage:
        """OpenAI's usage: each prompt once, the tokens of every sample (choice)."""
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = 0 if drop_generated else sum(len(s.token_ids) for o in outs for s in o.samples)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Head(_Response):
    id: str
    object: str
    created: int
    model: str


class UsageChunk(_Head):
    """The last event of a stream that asked for `stream_options.include_usage`."""

    object: Literal["text_completion", "chat.completion.chunk"]
    choices: list[Any] = Field(default_factory=list, max_length=0)
    usage: Usage


# ---------------------------------------------------------------------------------------------- completions
class CompletionLogprobs(_Response):
    """Per token of the choice's text: its string, logprob, top alternatives, character offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Head):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None = None


class CompletionChunk(_Head):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# ---------------------------------------------------------------------------------------------- chat
class ChatLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]
    refusal: None = None


class ToolCallFunction(_Response):
    name: str
    arguments: str  # JSON text (cut short, and then not valid JSON, when max_tokens cut the call)


class AssistantToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class DeltaToolCall(AssistantToolCall):
    index: int


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = Omitted()  # the reply's reasoning trace, with --reasoning-parser
    tool_calls: list[AssistantToolCall] | None = Omitted()


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(_Head):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = Omitted()
    content: str | None = Omitted()
    reasoning: str | None = Omitted()
    tool_calls: list[DeltaToolCall] | None = Omitted()


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Head):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: None = None
    choices: list[ChatChunkChoice]


# ---------------------------------------------------------------------------------------------- the rest
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minisgl"
    root: str  # the model reference without a server path
    parent: None = None
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfo(_Response):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    eos_token_id: int | None
    bos_token_id: int | None
    chat_template: str | dict[str, str] | None
    model_max_length: int
    vocab_size: int
    add_bos_token: bool | None


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"


class VersionResponse(_Response):
    version: str
