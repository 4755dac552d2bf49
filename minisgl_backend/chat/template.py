"""A conversation (OpenAI-format message dicts) + tools + response format -> prompt ids and logits processors.

Messages: `{"role": "system"|"user"|"assistant"|"tool"|..., "content": str}`; an assistant message
may carry `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments"}}]`,
arguments a dict or a JSON string) and a tool message `tool_call_id`. Templates that render
`tools=` themselves get the tools and calls natively; for the others (SmolLM2's ChatML) the tool
protocol is stated in a system message and calls and results are written as tagged text.
A forced tool choice constrains decoding with an llguidance grammar; a JSON response format is
such a forced call too (of a tool made from the format; its arguments are the reply).
"""

from __future__ import annotations

import inspect
import json
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from minisgl_backend.chat.grammar import GrammarProcessor, check_tool_schemas, tool_call_grammar
from minisgl_backend.chat.tools import call_text, tool_system_prompt

_native_tools: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
JSON_OBJECT_TOOL = "json_object"
JSON_OBJECT_PARAMS = {"type": "object", "additionalProperties": True}
_native_lock = threading.Lock()


class ChatTemplateError(ValueError):
    """The conversation, tools, tool choice or response format cannot be rendered as given."""


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders `tools=` itself (SmolLM2's ChatML silently ignores it)."""
    with _native_lock:
        if tokenizer not in _native_tools:
            probe = [{"role": "user", "content": "hi"}]
            tool = {
                "type": "function",
                "function": {
                    "name": "probe_tool",
                    "description": "",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
            with_tools = tokenizer.apply_chat_template(
                probe, tools=[tool], tokenize=False, add_generation_prompt=True
            )
            _native_tools[tokenizer] = "probe_tool" in with_tools
        return _native_tools[tokenizer]


def forced_tools(tool_choice: Any, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Tools one of which MUST be called (decoding is then constrained), or None when calling is optional.

    tool_choice: None / "auto" / "none" / False (optional), "any" / "required" / True (one of all),
    a tool name, `{"name": ...}` or OpenAI's `{"type": "function", "function": {"name": ...}}`.
    """
    if tool_choice in (None, "auto", "none", False):
        return None
    if tool_choice in ("any", "required", True):
        return tools
    if isinstance(tool_choice, dict):
        name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
    else:
        name = tool_choice
    match = [t for t in tools if t["function"]["name"] == name]
    if not isinstance(name, str) or not match:
        known = [t["function"]["name"] for t in tools]
        raise ChatTemplateError(f"tool_choice {tool_choice!r} names no bound tool; bound tools: {known}")
    return match


def response_tool(fmt: dict[str, Any], taken: Sequence[str] = ()) -> dict[str, Any]:
    """A JSON `response_format` as the tool the model is made to call: its arguments are the reply.

    One constraint for both: the reply is decoded under `tool_call_grammar` like any forced call, and
    the caller returns the call's arguments as the message content (`parse_tool_calls(reply_tool=)`).
    Why not a bare JSON grammar: constrained to the same schema without the tool prompt and call
    wrapper, greedy SmolLM2-135M repeats itself inside the first string until max_tokens
    ('{"setup":"The cat was a cat, and the cat was a cat, ...'), while as a forced call it writes a
    whole joke and stops. `json_schema` gives the name, description and parameters
    (`strict` is implied: decoding is always constrained); `json_object` allows any JSON object.
    `taken`: names of the request's own tools, which the reply tool must not shadow.
    """
    kind = fmt.get("type")
    if kind == "json_object":
        name, description = JSON_OBJECT_TOOL, "Reply to the user with a JSON object as the arguments."
        params: dict[str, Any] = dict(JSON_OBJECT_PARAMS)
    elif kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        params = dict(spec.get("schema", spec) or {"type": "object", "additionalProperties": True})
        # The schema's own title and description name and describe the tool, as in a tool made from
        # the same class (LangChain's convert_to_openai_tool): the prompts then match.
        title, about = params.pop("title", None), params.pop("description", None)
        name = spec.get("name") or title or "json_schema"
        description = spec.get("description") or about or "Reply with arguments that match the schema."
    else:
        raise ChatTemplateError(f"response_format type must be 'json_object' or 'json_schema', got {kind!r}")
    while name in taken:
        name = f"{name}_reply"
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def _args_dict(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: kept as text
            return args
    return args


def to_template(message: dict[str, Any], native: bool) -> dict[str, Any]:
    """One OpenAI-format message as a chat-template dict. Without native tool support, tool calls
    and results are written in the same tagged protocol the system prompt describes."""
    role, content = message["role"], message.get("content") or ""
    if role == "assistant":
        calls = message.get("tool_calls") or []
        if not calls:
            return {"role": "assistant", "content": content}
        if native:
            rendered = [
                {
                    "type": "function",
                    "id": c.get("id"),
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _args_dict(c["function"]["arguments"]),
                    },
                }
                for c in calls
            ]
            return {"role": "assistant", "content": content, "tool_calls": rendered}
        calls_text = "\n".join(
            call_text(c["function"]["name"], _args_dict(c["function"]["arguments"])) for c in calls
        )
        return {"role": "assistant", "content": f"{content}\n{calls_text}" if content else calls_text}
    if role == "tool":
        if native:
            return {"role": "tool", "content": content, "tool_call_id": message.get("tool_call_id")}
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": role, "content": content}


@dataclass
class ChatPrompt:
    """A rendered conversation: what to submit, and what to parse out of the reply."""

    text: str
    token_ids: list[int]
    logits_processors: list[Callable] = field(default_factory=list)
    tool_names: set[str] = field(default_factory=set)  # calls of these tools are parsed from the output
    # A response_format: the forced call of this tool is the reply, its arguments the content.
    reply_tool: str | None = None

    @property
    def parses_output(self) -> bool:
        """Whether the output goes through `parse_tool_calls` / `ToolCallStreamSplitter` (given
        `tool_names` and `reply_tool`): tagged blocks are calls only when tools or a format are set."""
        return bool(self.tool_names) or self.reply_tool is not None


def _template_kwargs(tokenizer: Any, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Extra variables for the template (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking);
    names that are apply_chat_template's own parameters are refused rather than passed twice."""
    if not kwargs:
        return {}
    own = {
        name
        for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    } | {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
    clash = sorted(set(kwargs) & own)
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: use the request's own fields")
    return dict(kwargs)


def _shown(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the model is told about it: a json_object reply tool without its parameter schema
    (`{"type": "object", "additionalProperties": true}` is what a small model would copy as its reply)."""
    fn = tool["function"]
    if fn["name"] == JSON_OBJECT_TOOL and fn.get("parameters") == JSON_OBJECT_PARAMS:
        return {**tool, "function": {k: v for k, v in fn.items() if k != "parameters"}}
    return tool


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    response_format: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatPrompt:
    """Render a conversation with the model's chat template (plus the tool / JSON instructions) and
    build the grammar processors a forced tool call or a JSON response format needs.
    `continue_final_message`: leave the last message open for the model to continue (the prompt ends
    inside it; then add_generation_prompt must be false). `template_kwargs`: extra template variables.
    A failing template is a ChatTemplateError (its first line)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model has no chat template; use plain completions instead")
    template_vars = _template_kwargs(tokenizer, template_kwargs)
    tools = list(tools or [])
    if tool_choice == "none":
        tools = []
    forced = forced_tools(tool_choice, tools) if tools else None
    names = {t["function"]["name"] for t in tools}
    reply = None
    if response_format is not None and response_format.get("type") != "text":
        reply = response_tool(response_format, sorted(names))
        if forced is None:
            # As OpenAI's structured outputs with tools: the reply is a call of a bound tool or the JSON.
            tools.append(reply)
            forced = list(tools)
        else:  # a forced call of the request's own tool leaves the format nothing to shape
            reply = None
    processors: list[Callable] = []
    instructions: list[str] = []
    native = bool(tools) and template_supports_tools(tokenizer)
    shown = [_shown(t) for t in tools]
    if tools and not native:
        name = forced[0]["function"]["name"] if forced and len(forced) == 1 else ("any" if forced else None)
        instructions.append(tool_system_prompt(shown, name))
    if forced:
        check_tool_schemas(tokenizer, forced)
        processors.append(GrammarProcessor(tokenizer, tool_call_grammar(forced)))
    msgs = [to_template(m, native) for m in messages]
    if instructions:
        extra = "\n\n".join(instructions)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{extra}"}
        else:
            msgs.insert(0, {"role": "system", "content": extra})
    try:
        text = tokenizer.apply_chat_template(
            msgs,
            tools=shown if native else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_vars,
        )
    except (TemplateError, ValueError, TypeError) as e:  # the template's raise_exception, a bad continuation
        raise ChatTemplateError(f"the chat template failed: {str(e).strip().splitlines()[0][:300]}") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))  # the template already holds any BOS
    return ChatPrompt(text, ids, processors, names, reply["function"]["name"] if reply else None)
