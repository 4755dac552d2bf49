"""ChatMiniSGL beyond the standard suites: rendering, constrained tool calls, streaming tool chunks."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_minisgl import ChatMiniSGL
from langchain_minisgl._tools import ToolCallStreamSplitter, parse_tool_calls
from pydantic import BaseModel


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Reading(BaseModel):
    # Bounded fields: a random model writing a free-form string may still run past max_tokens,
    # which no grammar can prevent; everything else about the shape is guaranteed.
    value: int
    unit: Literal["C", "F"]
    ok: bool


@pytest.fixture(scope="module")
def chat(tiny_model_dir, close_drained):
    """Seeded sampling (temperature 1) on the tiny random model: the worst case for well-formed output."""
    model = ChatMiniSGL(
        model=str(tiny_model_dir), temperature=1.0, seed=0, max_tokens=160, engine_config={"num_blocks": 512}
    )
    yield model
    close_drained(model)


def test_forced_tool_call_always_parses_even_from_a_random_model(chat):
    bound = chat.bind_tools([add], tool_choice="add")
    msgs = bound.batch([f"Add {i} and {i + 1}." for i in range(4)], config={"max_concurrency": 4})
    for m in msgs:
        assert not m.invalid_tool_calls, m.invalid_tool_calls
        (call,) = m.tool_calls
        assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
        assert all(isinstance(v, int) for v in call["args"].values())
        assert add.invoke(call["args"]) == call["args"]["a"] + call["args"]["b"]


def test_unconstrained_random_model_does_not_produce_a_call(chat):
    """Negative control: without tool_choice the same model emits noise, not a call."""
    m = chat.bind_tools([add]).invoke("Add 1 and 2.", temperature=0)
    assert not m.tool_calls


def test_streamed_forced_call_arrives_as_tool_call_chunks(chat):
    chunks = list(chat.bind_tools([add], tool_choice="any").stream("Add 2 and 3."))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert chunks[-1].chunk_position == "last" and chunks[-1].tool_call_chunks
    (call,) = full.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert full.usage_metadata["output_tokens"] > 0


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_structured_output_is_always_schema_valid(chat, method):
    out = chat.with_structured_output(Reading, method=method).invoke("It is 21 degrees Celsius.")
    assert isinstance(out, Reading)


async def test_async_forced_call(chat):
    m = await chat.bind_tools([add], tool_choice=True).ainvoke("Add 5 and 6.")
    assert m.tool_calls and m.tool_calls[0]["name"] == "add"


def test_bad_tool_choice_is_rejected_at_bind(chat):
    with pytest.raises(ValueError, match="names no bound tool"):
        chat.bind_tools([add], tool_choice="multiply")


def test_conversation_renders_every_role_through_the_chat_template(chat):
    history = [
        SystemMessage("You are terse."),
        HumanMessage("What is 2 + 3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}]),
        ToolMessage("5", tool_call_id="call_1"),
    ]
    _, ids, _, names = chat._prepare(history, None, {"tools": [_openai(add)]})
    text = chat.engine.tokenizer.decode(ids)
    assert names == {"add"}
    assert text.startswith("<|im_start|>system\nYou are terse.") and "You can call these tools" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    m = chat.invoke(history, max_tokens=4)
    assert m.usage_metadata["input_tokens"] == chat.get_num_tokens_from_messages(history)
    assert m.response_metadata["model_name"] == chat.model_name


def _openai(t):
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(t)


def test_unknown_field_and_call_option_are_rejected(tiny_model_dir, chat):
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_new_tokens'\]"):
        ChatMiniSGL(model=str(tiny_model_dir), max_new_tokens=5)
    with pytest.raises(TypeError, match="best_of"):
        chat.invoke("hi", best_of=2)


def test_failing_request_surfaces_as_an_exception(chat, monkeypatch):
    """A logits processor that raises fails its request in the engine; the caller sees that exception."""
    import minisgl_backend.chat.template as template  # the engine-level renderer builds the processors

    class Boom(template.GrammarProcessor):
        def __call__(self, output_ids, logits):
            raise RuntimeError("boom in the engine")

    monkeypatch.setattr(template, "GrammarProcessor", Boom)
    with pytest.raises(RuntimeError, match="boom in the engine"):
        chat.bind_tools([add], tool_choice="add").invoke("Add 1 and 2.")


def test_parse_tool_calls_handles_tags_bare_json_and_garbage():
    content, calls, invalid = parse_tool_calls(
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', {"add"}
    )
    assert content == "Sure.\n" and calls[0]["args"] == {"a": 1, "b": 2} and not invalid
    content, calls, _ = parse_tool_calls('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', {"add"})
    assert content == "" and calls[0]["args"] == {"a": 1, "b": 2}
    content, calls, invalid = parse_tool_calls('<tool_call>{"name": "add", "argu', {"add"})
    assert not calls and invalid and invalid[0]["args"].startswith('{"name"')
    assert parse_tool_calls('{"x": 1}', {"add"}) == ('{"x": 1}', [], [])


def test_stream_splitter_holds_back_only_what_may_be_a_call():
    s = ToolCallStreamSplitter()
    emitted = s.feed("Let me check") + s.feed(" <tool_") + s.feed('call>\n{"name": "add", "arguments": {}}')
    assert emitted == "Let me check "
    tail, calls, _ = s.finish({"add"})
    assert tail == "" and calls[0]["name"] == "add"
    s = ToolCallStreamSplitter()
    assert s.feed("a < b") == "a < b"
