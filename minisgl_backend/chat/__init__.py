"""Chat at the engine level, shared by `minisgl serve` and the LangChain adapter: chat-template
rendering with tools (`template`), the tool-call prompt and parser (`tools`) and grammar-constrained
decoding (`grammar`, llguidance)."""

from minisgl_backend.chat.grammar import GrammarError, GrammarProcessor, guide_grammar, tool_call_grammar
from minisgl_backend.chat.template import (
    ChatPrompt,
    ChatTemplateError,
    forced_tools,
    render_chat,
    response_tool,
    template_supports_tools,
    to_template,
)
from minisgl_backend.chat.tools import (
    ToolCallStreamSplitter,
    new_call_id,
    parse_tool_calls,
    partial_tool_call,
    reply_arguments,
    tool_system_prompt,
)

__all__ = [
    "ChatPrompt",
    "ChatTemplateError",
    "GrammarError",
    "GrammarProcessor",
    "ToolCallStreamSplitter",
    "forced_tools",
    "guide_grammar",
    "new_call_id",
    "parse_tool_calls",
    "partial_tool_call",
    "render_chat",
    "reply_arguments",
    "response_tool",
    "template_supports_tools",
    "to_template",
    "tool_call_grammar",
    "tool_system_prompt",
]
