"""Constrained decoding: a logits processor that only lets the engine sample grammar-valid tokens.

Shared by `minisgl serve` and the LangChain adapter.

Backed by llguidance (Earley parser + token trie, native code, CPU, no torch dependency). Used for
forced tool calls (the output must parse as a call of one of the allowed tools), which JSON /
JSON-schema structured output (`response_format`) is too: see `chat.template.response_tool`.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
import torch

# Compact JSON: fixed separators, no free whitespace (a small model left free to choose whitespace
# can pad forever). json.dumps' spaced separators, as the tool prompt shows them, bring no net gain
# for whole calls: a small greedy model (SmolLM2-135M) gets some calls right that compact JSON gets
# wrong and others wrong that it gets right; they stay for the one place they help (`_args_style`).
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}
_SPACED: JsonCompileOptions = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_tokenizers: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_tok_lock = threading.Lock()


class GrammarError(ValueError):
    """llguidance cannot compile the grammar built from a schema, or cannot follow it (its limits)."""


def _why(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, first line only (the rest is a dump of the parser's state)."""
    return matcher.get_error().strip().split("\n", 1)[0][:300]


def guide_grammar(kind: str, value: Any) -> str:
    """An llguidance grammar for a constraint on the whole output (vLLM's guided_* fields): `regex`
    (the output matches it), `choice` (it is one of the strings), `grammar` (Lark source, llguidance's
    dialect), `json` (a JSON schema, compact JSON), `json_object` (any JSON object)."""
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        )
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)
    if kind in ("json", "json_object"):
        schema = value if kind == "json" else {"type": "object"}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_COMPACT)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(
                f"cannot compile the JSON schema: {str(e).strip().split(chr(10))[0][:300]}"
            ) from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


def _ll_tokenizer(hf_tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of an HF tokenizer (decodes the whole vocabulary once, ~0.3 s): cached."""
    with _tok_lock:
        tok = _tokenizers.get(hf_tokenizer)
        if tok is None:
            tok = llguidance.hf.from_tokenizer(hf_tokenizer)
            _tokenizers[hf_tokenizer] = tok
        return tok


def _args_style(params: dict[str, Any]) -> JsonCompileOptions:
    """How a tool's arguments are written: compact JSON, except for an object that declares no
    properties (json_object's "any JSON object"). There the model picks each value's type, and
    compact JSON forbids the `": "` it would write before a string, so greedy SmolLM2-135M takes a
    `{` instead and nests objects until max_tokens ('{"setup":{"setup":{...'); with json.dumps'
    separators it writes a flat object. A declared property's type fixes that token."""
    undeclared = not params.get("properties") and params.get("additionalProperties", False) is not False
    return _SPACED if params.get("type") == "object" and undeclared else _COMPACT


def call_prefix(name: str) -> str:
    """How every output of `tool_call_grammar` that calls `name` begins (the grammar's own literal):
    the tag and the call object up to its arguments, so the arguments can be cut out as they stream."""
    return f'{TOOL_CALL_OPEN}\n{{"name":{json.dumps(name, ensure_ascii=False)},"arguments":'


CALL_SUFFIX = "}\n" + TOOL_CALL_CLOSE  # how it ends: the call object's brace, then the closing tag


def _tool_params(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if params.get("type") == "object" and "additionalProperties" not in params:
        # Only declared arguments: a small model otherwise invents extra keys until max_tokens.
        params = {**params, "additionalProperties": False}
    return params


def check_tool_schemas(hf_tokenizer: Any, tools: Sequence[dict[str, Any]]) -> None:
    """Each tool's arguments grammar, alone, compiled and its first mask computed: inside the call
    wrapper a schema beyond llguidance's limits (a recursive $ref) would only fail once decoding
    reaches the arguments; this makes it a GrammarError before the request is queued."""
    for t in tools:
        params = _tool_params(t["function"])
        source = f"start: %json {json.dumps({**params, 'x-guidance': _args_style(params)})}"
        GrammarProcessor(hf_tokenizer, llguidance.LLMatcher.grammar_from_lark(source))


def tool_call_grammar(tools: Sequence[dict[str, Any]]) -> str:
    """Lark grammar for exactly one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    the arguments matching the chosen tool's parameter schema."""
    rules = []
    for i, t in enumerate(tools):
        fn = t["function"]
        params = _tool_params(fn)
        opening = json.dumps(call_prefix(fn["name"])[len(TOOL_CALL_OPEN) + 1 :], ensure_ascii=False)
        args = json.dumps({**params, "x-guidance": _args_style(params)})
        rules.append(f'call{i}: {opening} args{i} "}}"\nargs{i}: %json {args}')
    calls = " | ".join(f"call{i}" for i in range(len(tools)))
    start = f'start: "{TOOL_CALL_OPEN}\\n" ({calls}) "\\n{TOOL_CALL_CLOSE}"'
    return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]))


class GrammarProcessor:
    """Per-request logits processor: masks every token the grammar forbids (EOS once complete).

    The engine calls it on the executor's copy worker (the sampling stage, `executor/sample_stage.py`, run
    from `executor/base.py`), before the draw, with all output ids so far; it feeds the matcher the
    ids it has not seen, then masks. One instance serves one sequence only (it holds parser state):
    the engine calls fork() for each sample of a request (SamplingParams.n) and each prompt that shares
    the params, so every sequence gets its own state from the grammar's start.
    """

    def __init__(self, hf_tokenizer: Any, grammar: str) -> None:
        self._tok = _ll_tokenizer(hf_tokenizer)
        self._grammar = grammar
        self._matcher = llguidance.LLMatcher(self._tok, grammar)
        if self._matcher.is_error():
            raise GrammarError(f"cannot compile the output grammar: {_why(self._matcher)}")
        # The first token's mask, now: a grammar that compiles but exceeds llguidance's limits (a
        # recursive $ref chain, a huge counted repetition) fails here, before the request is queued.
        self._first: bytes | None = self._matcher.compute_bitmask()
        if self._matcher.is_error():
            raise GrammarError(f"the output grammar exceeds the parser's limits: {_why(self._matcher)}")
        self._start = self._matcher.deep_copy()  # the state at the grammar's start, never advanced
        self._first_mask = self._first
        self._seen = 0

    def fork(self) -> GrammarProcessor:
        """A processor of the same grammar with its own parser state, at the grammar's start (no
        recompile: the parser state is copied)."""
        twin = copy.copy(self)  # a subclass stays that subclass; the tokenizer and start are shared
        twin._matcher = self._start.deep_copy()
        twin._first = self._first_mask
        twin._seen = 0
        return twin

    @property
    def grammar(self) -> str:
        """The compiled grammar's source: what another process needs to rebuild this processor."""
        return self._grammar

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) < self._seen:  # a preempted request recomputes: replay from scratch
            self._matcher = self._start.deep_copy()
            self._seen = 0
        if len(output_ids) > self._seen:
            self._matcher.consume_tokens(list(output_ids[self._seen :]))
            self._seen = len(output_ids)
        if self._matcher.is_error():
            raise GrammarError(f"output left the grammar: {_why(self._matcher)}")
        mask, self._first = (self._first, None) if self._seen == 0 and self._first else (None, None)
        if mask is None:
            mask = self._matcher.compute_bitmask()
            if self._matcher.is_error():
                raise GrammarError(f"the output grammar exceeds the parser's limits: {_why(self._matcher)}")
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.shape[-1]].astype(bool))
        if allowed.shape[0] < logits.shape[-1]:  # padded model vocab beyond the tokenizer's: never valid
            allowed = torch.cat([allowed, torch.zeros(logits.shape[-1] - allowed.shape[0], dtype=torch.bool)])
        return logits.masked_fill(~allowed, float("-inf"))
