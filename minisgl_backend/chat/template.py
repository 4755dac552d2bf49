"""A conversation (OpenAI-format message dicts) + tools + response format -> prompt ids and logits processors.

Messages: `{"role": "system"|"user"|"assistant"|"tool"|..., "content": str}`; an assistant message
may carry `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments"}}]`,
arguments a dict or a JSON string) and a tool message `tool_call_id`. Templates that render
`tools=` themselves get the tools and calls natively; for the others (SmolLM2's ChatML) the tool
protocol is stated in a system message and calls and results are written as tagged text.
A forced tool choice or a JSON response format constrains decoding with an llguidance grammar.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl_backend.chat.grammar import GrammarProcessor, json_grammar, tool_call_grammar
from minisgl_backend.chat.tools import call_text, tool_system_prompt

_native_tools: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
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


def response_schema(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of an OpenAI `response_format` (None: any JSON object)."""
    kind = fmt.get("type")
    if kind == "json_object":
        return None
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        return spec.get("schema", spec)
    raise ChatTemplateError(f"response_format type must be 'json_object' or 'json_schema', got {kind!r}")


def _args_dict(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
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


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    response_format: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> ChatPrompt:
    """Render a conversation with the model's chat template (plus the tool / JSON instructions) and
    build the grammar processors a forced tool call or a JSON response format needs."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model has no chat template; use plain completions instead")
    tools = list(tools or [])
    if tool_choice == "none":
        tools = []
    forced = forced_tools(tool_choice, tools) if tools else None
    processors: list[Callable] = []
    instructions: list[str] = []
    native = bool(tools) and template_supports_tools(tokenizer)
    if tools and not native:
        name = forced[0]["function"]["name"] if forced and len(forced) == 1 else ("any" if forced else None)
        instructions.append(tool_system_prompt(tools, name))
    if forced:
        processors.append(GrammarProcessor(tokenizer, tool_call_grammar(forced)))
    if response_format is not None and response_format.get("type") != "text":
        schema = response_schema(response_format)
        processors.append(GrammarProcessor(tokenizer, json_grammar(schema)))
        instructions.append(
            "Reply with a JSON object only"
            + (f" matching this JSON schema:\n{json.dumps(schema)}" if schema else ".")
        )
    msgs = [to_template(m, native) for m in messages]
    if instructions:
        extra = "\n\n".join(instructions)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{extra}"}
        else:
            msgs.insert(0, {"role": "system", "content": extra})
    text = tokenizer.apply_chat_template(
        msgs, tools=tools if native else None, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids = list(tokenizer.encode(text, add_special_tokens=False))  # the template already holds any BOS
    return ChatPrompt(text, ids, processors, {t["function"]["name"] for t in tools})
