"""Tool calling over plain text: the prompt that teaches the protocol, and parsing calls back out.

The protocol is the Hermes/Qwen one (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
which chat templates with native tool support already use; for templates that ignore `tools=`
(SmolLM2's ChatML) the prompt states it in a system message itself.

Parsed calls are plain dicts: `{"name", "args", "id"}` for a call, `{"name", "args", "id", "error",
"text"}` (args: the raw text inside the tags; text: the whole block as written, tags included) for
one that does not parse. The LangChain adapter wraps them into its
ToolCall / InvalidToolCall; the server into OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from minisgl_backend.chat.grammar import CALL_SUFFIX, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, call_prefix

_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.S
)

ParsedCall = dict[str, Any]


def tool_system_prompt(tools: Sequence[dict[str, Any]], forced: str | None) -> str:
    specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    must = (
        f"You must call the tool `{forced}` now."
        if forced and forced != "any"
        else "You must call one of the tools now."
        if forced
        else "Call a tool only when it helps; otherwise answer directly."
    )
    return (
        "You can call these tools:\n<tools>\n" + specs + "\n</tools>\n"
        "To call a tool, reply with exactly:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n'
        f"{TOOL_CALL_CLOSE}\n"
        "A tool's result comes back inside <tool_response></tool_response>; use it to answer the user. "
        + must
    )


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_text(name: str, args: Any) -> str:
    """One call written in the tagged protocol (how earlier calls are shown to the model)."""
    call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"


def _parse_one(
    body: str, calls: list[ParsedCall], invalid: list[ParsedCall], text: str | None = None
) -> None:
    try:
        obj = json.loads(body)
        name = obj["name"]
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(name, str) or not isinstance(args, dict):
            raise TypeError("'name' must be a string and 'arguments' an object")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        invalid.append(
            {
                "name": None,
                "args": body,
                "id": new_call_id(),
                "error": f"unparseable tool call: {e}",
                "text": body if text is None else text,
            }
        )
        return
    calls.append({"name": name, "args": args, "id": new_call_id()})


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*)\Z', re.S)


def _scan(text: str) -> tuple[list[str], bool, list[int]]:
    """(open brackets, inside a string, positions of `,` `{` `[` outside strings) of a JSON prefix."""
    stack: list[str] = []
    cuts: list[int] = []
    in_str = esc = False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append(ch)
            cuts.append(i)
        elif ch in "}]":
            if stack:
                stack.pop()
        elif ch == ",":
            cuts.append(i)
    return stack, in_str, cuts


def close_partial_json(text: str) -> str:
    """A cut JSON object made whole: what was written, less a member left incomplete, with its open
    strings and brackets closed (`{"text": "hel` -> `{"text": "hel"}`, `{"a": 1, "b":` -> `{"a": 1}`):
    the partial object, valid JSON; "{}" when nothing of it survives."""
    for _ in range(8):  # each round drops one incomplete member
        stack, in_str, cuts = _scan(text)
        tail = text
        if in_str:
            tail = tail[:-1] if tail.endswith("\\") and not tail.endswith("\\\\") else tail
            tail += '"'
        candidate = tail + "".join("}" if c == "{" else "]" for c in reversed(stack))
        try:
            json.loads(candidate)
            return candidate
        except ValueError:
            pass
        if not cuts:
            break
        last = cuts[-1]
        text = text[:last] if text[last] == "," else text[: last + 1]
    return "{}"


def partial_tool_call(body: str, tool_names: set[str]) -> dict[str, str] | None:
    """A tagged call that does not parse but got as far as its arguments (a forced call cut by
    max_tokens): `{"name", "arguments"}` with the partial object written so far (closed into valid
    JSON by `close_partial_json`, so that clients' parsers return or reject it rather than drop the
    call), or None when the name is not yet complete or names no bound tool."""
    m = _CALL_HEAD.match(body)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return None
    if name not in tool_names:
        return None
    return {"name": name, "arguments": close_partial_json(m.group(2))}


def reply_arguments(text: str, reply_tool: str) -> str | None:
    """The JSON a forced call of `reply_tool` carries (a response_format's reply), as the model wrote
    it: all of it, or as far as max_tokens let it go. None: `text` is not that call."""
    prefix = call_prefix(reply_tool)
    if text.startswith(prefix):
        body = text[len(prefix) :]
        return body[: -len(CALL_SUFFIX)] if body.endswith(CALL_SUFFIX) else body
    return "" if prefix.startswith(text) else None  # cut inside the fixed wrapper: no JSON yet


def parse_tool_calls(
    text: str, tool_names: set[str], reply_tool: str | None = None
) -> tuple[str, list[ParsedCall], list[ParsedCall]]:
    """Split model output into (content, tool calls, invalid tool calls).

    Tagged blocks are calls wherever they appear; an untagged reply that is nothing but a JSON object
    naming a bound tool is a call too (small models often drop the tags). A call of `reply_tool`
    (see `chat.template.response_tool`) is no call: its arguments are the content.
    """
    if reply_tool is not None and (args := reply_arguments(text, reply_tool)) is not None:
        return args, [], []
    calls: list[ParsedCall] = []
    invalid: list[ParsedCall] = []
    pieces, pos = [], 0
    for m in _BLOCK.finditer(text):
        pieces.append(text[pos : m.start()])
        pos = m.end()
        _parse_one(m.group(1), calls, invalid, m.group(0))
    pieces.append(text[pos:])
    content = "".join(pieces)
    if not calls and not invalid and content.strip().startswith("{"):
        try:
            obj = json.loads(content)
        except ValueError:
            return content, calls, invalid
        if isinstance(obj, dict) and obj.get("name") in tool_names:
            _parse_one(content, calls, invalid)
            content = ""
    if not content.strip():
        content = ""
    return content, calls, invalid


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStreamSplitter:
    """While text streams in, emit what is surely plain content and hold back what may be a tool call.

    With `reply_tool` (a response_format), that forced call's arguments stream out as content as
    they come, less a tail that may be the call's closing `}` and tag.
    """

    def __init__(self, reply_tool: str | None = None) -> None:
        self.text = ""
        self.emitted = 0  # characters of content sent: of `text`, or of the reply's arguments
        self._holding = False
        self._reply_tool = reply_tool
        self._reply_prefix = call_prefix(reply_tool) if reply_tool is not None else None

    def _feed_reply(self) -> str | None:
        """The next piece of the reply's arguments; None once the output is not the reply call."""
        prefix = self._reply_prefix
        if prefix is None:
            return None
        if self.text.startswith(prefix):
            body = self.text[len(prefix) :]
            hold = len(CALL_SUFFIX) if body.endswith(CALL_SUFFIX) else _partial_suffix(body, CALL_SUFFIX)
            out = body[self.emitted : len(body) - hold]
            self.emitted += len(out)
            return out
        return "" if prefix.startswith(self.text) else None

    def feed(self, delta: str) -> str:
        self.text += delta
        reply = self._feed_reply()
        if reply is not None:
            return reply
        if self._holding:
            return ""
        rest = self.text[self.emitted :]
        i = rest.find(TOOL_CALL_OPEN)
        if i != -1:
            out, self._holding = rest[:i], True
        elif self.emitted == 0 and not rest.strip():
            out = ""  # leading whitespace may precede a bare-JSON call
        elif self.emitted == 0 and rest.lstrip().startswith("{"):
            out, self._holding = "", True
        else:
            out = rest[: len(rest) - _partial_suffix(rest, TOOL_CALL_OPEN)]
        self.emitted += len(out)
        return out

    def finish(self, tool_names: set[str]) -> tuple[str, list[ParsedCall], list[ParsedCall]]:
        """(content not yet emitted, tool calls, invalid tool calls) once the output is complete."""
        content, calls, invalid = parse_tool_calls(self.text, tool_names, self._reply_tool)
        if self._reply_tool is not None and reply_arguments(self.text, self._reply_tool) is not None:
            return content[self.emitted :], calls, invalid  # `emitted` counted the arguments
        done = self.text[: self.emitted]
        tail = content[len(done) :] if content.startswith(done) else ""
        return tail, calls, invalid
