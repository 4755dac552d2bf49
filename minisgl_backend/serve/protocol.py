"""Request models of the OpenAI-compatible API (pydantic, strict types, unknown fields rejected);
a completion or chat request turns itself into the engine's `SamplingParams` (`to_sampling_params`).
The response models are in serve/responses.py.

Fields OpenAI defines that the engine cannot honour are accepted only at their neutral value
(`best_of: 1`, ...), so a client that relies on them gets a 400 instead of a silently
different answer. The sampling fields the API spells as the engine does (`temperature`, `top_p`,
the penalties, vLLM's `top_k`, `min_p`, `ignore_eos`, ...) are derived from SamplingParams's fields,
with their bounds and docs (`engine_sampling_model`); the others are declared here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, model_validator

from minisgl_backend.types import SamplingParams, pydantic_fields, surface_fields
from minisgl_backend.validation import LOGIT_BIAS_LIMIT

MAX_N = 128
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key longer than this is no token id (and int() of 5,000 digits fails)

_STRICT = ConfigDict(strict=True, extra="forbid")


Bias = Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT, allow_inf_nan=False)]

# What /openapi.json says of `stop` and `logit_bias`: the same rules as the checks in
# `_SamplingFields._check_stop`, so that a client built from the schema sends nothing they refuse.
MAX_STOPS = 16
_STOP_TEXT = {"type": "string", "minLength": 1}
_STOP_SCHEMA = {
    "anyOf": [_STOP_TEXT, {"type": "array", "items": _STOP_TEXT, "maxItems": MAX_STOPS}, {"type": "null"}]
}
_BIAS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"pattern": f"^(0|[1-9][0-9]{{0,{MAX_TOKEN_ID_DIGITS - 1}}})$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -LOGIT_BIAS_LIMIT,
                "maximum": LOGIT_BIAS_LIMIT,
            },
        },
        {"type": "null"},
    ]
}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class Guide:
    """A constraint on the whole output: `kind` json (a JSON schema, dict), json_object, regex,
    choice (a list of strings) or grammar (Lark, llguidance's dialect)."""

    kind: str
    value: Any

    def response_format(self) -> dict[str, Any]:
        """A json / json_object guide as the chat endpoint's response_format."""
        if self.kind == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "json_schema": {"name": None, "description": None, "schema": self.value},
        }


Choice = Annotated[str, Field(min_length=1)]


def _schema_object(text: str) -> dict[str, Any]:
    import json

    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except RecursionError:  # nested past the parser's depth: no schema is that deep
        raise ValueError("the JSON schema is nested too deeply to parse") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    return schema


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: exactly one of these."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[Choice] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
            )
        if isinstance(self.json_, str):
            self.json_ = _schema_object(self.json_)
        return self

    def guide(self) -> Guide:
        if self.json_object:
            return Guide("json_object", None)
        for kind, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice)):
            if value is not None:
                return Guide(kind, value)
        return Guide("grammar", self.grammar)


# The request fields the API spells as SamplingParams does, with its bounds and docs; None (JSON null)
# is the engine's default. The API's own spellings are declared by hand below: `max_tokens` (each
# endpoint's default and rule), `stop` (a string or a list, at most MAX_STOPS), `logit_bias` (JSON's
# keys are strings), `n` (at most MAX_N, read by the routes) and `logprobs` (an int in completions,
# a bool with `top_logprobs` in chat).
API_SPELLED = ("max_tokens", "stop", "logit_bias", "n", "logprobs")
# OpenAI's seed is a signed 64-bit integer: its clients send nothing at or above 2**63.
_API_NARROW = {"seed": {"lt": 2**63}}


def engine_sampling_model(params_cls: type[SamplingParams] = SamplingParams) -> type[BaseModel]:
    """The pydantic model of the request fields derived from `params_cls`'s fields."""
    fields = {k: f for k, f in surface_fields("server", params_cls).items() if k not in API_SPELLED}
    defs = pydantic_fields(fields, nullable=True, narrow=_API_NARROW)
    return create_model("EngineSamplingFields", __config__=_STRICT, **defs)


if TYPE_CHECKING:
    _EngineSampling = BaseModel
else:
    _EngineSampling = engine_sampling_model()
ENGINE_FIELDS = tuple(_EngineSampling.model_fields)


class _SamplingFields(_EngineSampling):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = _STRICT

    model: str | None = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's own limit; it also bounds what one HTTP request can queue
    n: int = Field(1, ge=1, le=MAX_N, description="parallel samples of each prompt")
    logit_bias: Annotated[dict[str, Bias] | None, WithJsonSchema(_BIAS_SCHEMA)] = Field(
        None, description="token id (a string) -> bias in [-100, 100]"
    )
    user: str | None = None
    # vLLM's constrained decoding (llguidance): at most one of these
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Choice] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def guide(self) -> Guide | None:
        """The one constraint asked for with vLLM's fields (checked: at most one), or None."""
        found = [
            Guide(kind, value)
            for kind, value in (
                ("json", self.guided_json),
                ("regex", self.guided_regex),
                ("choice", self.guided_choice),
                ("grammar", self.guided_grammar),
            )
            if value is not None
        ]
        if self.structured_outputs is not None:
            found.append(self.structured_outputs.guide())
        return found[0] if found else None

    @model_validator(mode="after")
    def _check_guides(self) -> _SamplingFields:
        fields = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"]
        given = [f for f in fields if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one constraint, got {given}")
        if isinstance(self.guided_json, str):
            self.guided_json = _schema_object(self.guided_json)
        return self

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        bad = [
            k[:20]
            for k in self.logit_bias or {}
            if not (k.isascii() and k.isdigit() and len(k) <= MAX_TOKEN_ID_DIGITS)
        ]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {bad[:5]}")
        # "00005" and "5" would name one token with two biases, one silently lost: one spelling only
        padded = [k[:20] for k in self.logit_bias or {} if len(k) > 1 and k.startswith("0")]
        if padded:
            raise ValueError(f"logit_bias keys must be token ids without leading zeros, got {padded[:5]}")
        return self

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token (None: no logprobs); each endpoint spells it its way."""
        raise NotImplementedError

    def to_sampling_params(
        self,
        max_tokens: int,
        vocab_size: int,
        processors: Sequence[Callable[..., Any]] = (),
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters for this request (the defaults where the client sent none), with
        the `max_tokens` the route settled on against the context; checked against the vocabulary
        now, so a bad token id is a 400 rather than a failed request at its first draw."""
        given = {k: v for k in ENGINE_FIELDS if (v := getattr(self, k)) is not None}
        params = SamplingParams(
            **given,
            max_tokens=max_tokens,
            stop=self.stops,
            logprobs=self.num_logprobs,
            prompt_logprobs=prompt_logprobs,
            logits_processors=tuple(processors),
            logit_bias=tuple(self.logit_bias_ids.items()),
            n=self.n,
        )
        params.check_vocab(vocab_size)
        return params


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    # At most the engine's max_logprobs (EngineConfig, the one limit): checked at submit, a 400 naming it.
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    suffix: str | None = Field(None, max_length=0, description="not supported")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if (
            isinstance(self.prompt, list)
            and isinstance(self.prompt[0], list)
            and any(not p for p in self.prompt)
        ):
            raise ValueError("prompt token lists must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only meaningful with echo (scoring the prompt)")
        return self


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.get("type") != "text":
                    raise ValueError(
                        f"content part {i} has type {part.get('type')!r}; only 'text' parts are supported"
                    )
                TextPart.model_validate(part)
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""

    def chars(self) -> int:
        """The characters the chat template renders from this message: its text and the names and
        arguments of its tool calls."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text()) + calls

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (a developer message is a system one to them)."""
        d: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.role == "tool":
            d["tool_call_id"] = self.tool_call_id
        return d


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")  # OpenAI's rule
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs a json_schema object")
        return self

    def as_dict(self) -> dict[str, Any]:
        if self.type == "json_schema" and self.json_schema is not None:
            spec = self.json_schema
            # name and description reach the model: the reply is a forced call of a tool made of them
            return {
                "type": "json_schema",
                "json_schema": {
                    "name": spec.name,
                    "description": spec.description,
                    "schema": spec.schema_ or {},
                },
            }
        return {"type": self.type}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs, as logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's chat-template controls
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # accepted and ignored: they do not change what the engine computes
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            if not self.tools:
                raise ValueError("tool_choice requires tools")
        _check_continuation(self.add_generation_prompt, self.continue_final_message)
        if (
            self.guide is not None
            and self.response_format not in (None,)
            and self.response_format.type != "text"
        ):
            raise ValueError("give either response_format or a guided_* / structured_outputs constraint")
        if self.guide is not None and self.tools and self.tool_choice != "none":
            raise ValueError("guided_* / structured_outputs cannot be combined with tools")
        return self


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        _check_continuation(self.add_generation_prompt, self.continue_final_message)
        return self


def _check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message continues the last message, add_generation_prompt starts a new one: "
            "set add_generation_prompt false with it"
        )


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]
