"""Tool calling for ChatMiniSGL: the engine-level protocol (`minisgl_backend.chat.tools`, shared with
`minisgl serve`) with its parsed calls wrapped into LangChain's ToolCall / InvalidToolCall."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.messages.tool import invalid_tool_call, tool_call

from minisgl_backend.chat import tools as _core
from minisgl_backend.chat.tools import new_call_id, tool_system_prompt  # noqa: F401

__all__ = ["ToolCallStreamSplitter", "new_call_id", "parse_tool_calls", "tool_system_prompt"]


def _wrap(
    calls: list[dict[str, Any]], invalid: list[dict[str, Any]]
) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    return (
        [tool_call(name=c["name"], args=c["args"], id=c["id"]) for c in calls],
        [invalid_tool_call(name=c["name"], args=c["args"], id=c["id"], error=c["error"]) for c in invalid],
    )


def parse_tool_calls(
    text: str, tool_names: set[str], reply_tool: str | None = None
) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split model output into (content, tool calls, invalid tool calls); see the engine-level parser."""
    content, calls, invalid = _core.parse_tool_calls(text, tool_names, reply_tool)
    return (content, *_wrap(calls, invalid))


class ToolCallStreamSplitter(_core.ToolCallStreamSplitter):
    """While text streams in, emit what is surely plain content and hold back what may be a tool call."""

    def finish(self, tool_names: set[str]) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:  # type: ignore[override]
        tail, calls, invalid = super().finish(tool_names)
        return (tail, *_wrap(calls, invalid))
