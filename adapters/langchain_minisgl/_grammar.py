"""Moved to `minisgl_backend.chat.grammar` (shared with `minisgl serve`); re-exported here."""

from minisgl_backend.chat.grammar import (  # noqa: F401
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    GrammarError,
    GrammarProcessor,
    tool_call_grammar,
)
