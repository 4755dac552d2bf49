"""Constrained decoding: a logits processor that only lets the engine sample grammar-valid tokens.

Shared by `minisgl serve` and the LangChain adapter.

Backed by llguidance (Earley parser + token trie, native code, CPU, no torch dependency). Used for
forced tool calls (the output must parse as a call of one of the allowed tools) and for JSON /
JSON-schema structured output.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

# Compact JSON: a small model left free to choose whitespace can pad forever.
_RIGID = {"whitespace_flexible": False}
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_tokenizers: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_tok_lock = threading.Lock()


class GrammarError(ValueError):
    """llguidance cannot compile the grammar built from a schema."""


def _ll_tokenizer(hf_tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of an HF tokenizer (decodes the whole vocabulary once, ~0.3 s): cached."""
    with _tok_lock:
        tok = _tokenizers.get(hf_tokenizer)
        if tok is None:
            tok = llguidance.hf.from_tokenizer(hf_tokenizer)
            _tokenizers[hf_tokenizer] = tok
        return tok


def tool_call_grammar(tools: Sequence[dict[str, Any]]) -> str:
    """Lark grammar for exactly one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    the arguments matching the chosen tool's parameter schema."""
    alternatives = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if params.get("type") == "object" and "additionalProperties" not in params:
            # Only declared arguments: a small model otherwise invents extra keys until max_tokens.
            params = {**params, "additionalProperties": False}
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    body = json.dumps({**schema, "x-guidance": _RIGID})
    lark = f'start: "{TOOL_CALL_OPEN}\\n" call "\\n{TOOL_CALL_CLOSE}"\ncall: %json {body}'
    return llguidance.LLMatcher.grammar_from_lark(lark)


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Grammar for one JSON value matching `schema` (None: any JSON object)."""
    schema = dict(schema) if schema else {"type": "object"}
    schema["x-guidance"] = _RIGID
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


class GrammarProcessor:
    """Per-request logits processor: masks every token the grammar forbids (EOS once complete).

    The engine calls it on the executor's copy worker (the sampling stage, `executor/sample_stage.py`, run
    from `executor/base.py`), before the draw, with all output ids so far; it feeds the matcher the
    ids it has not seen, then masks. One instance serves one request only (it holds parser state).
    """

    def __init__(self, hf_tokenizer: Any, grammar: str) -> None:
        self._tok = _ll_tokenizer(hf_tokenizer)
        self._grammar = grammar
        self._matcher = llguidance.LLMatcher(self._tok, grammar)
        if self._matcher.is_error():
            raise GrammarError(f"cannot compile the output grammar: {self._matcher.get_error()}")
        self._seen = 0

    @property
    def grammar(self) -> str:
        """The compiled grammar's source: what another process needs to rebuild this processor."""
        return self._grammar

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) < self._seen:  # a preempted request recomputes: replay from scratch
            self._matcher = llguidance.LLMatcher(self._tok, self._grammar)
            self._seen = 0
        if len(output_ids) > self._seen:
            self._matcher.consume_tokens(list(output_ids[self._seen :]))
            self._seen = len(output_ids)
        if self._matcher.is_error():
            raise GrammarError(f"output left the grammar: {self._matcher.get_error()}")
        bits = np.unpackbits(
            np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        allowed = torch.from_numpy(bits[: logits.shape[-1]].astype(bool))
        if allowed.shape[0] < logits.shape[-1]:  # padded model vocab beyond the tokenizer's: never valid
            allowed = torch.cat([allowed, torch.zeros(logits.shape[-1] - allowed.shape[0], dtype=torch.bool)])
        return logits.masked_fill(~allowed, float("-inf"))
