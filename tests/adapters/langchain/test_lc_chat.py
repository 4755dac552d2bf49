"""ChatMiniSGL beyond the standard suites: rendering, constrained tool calls, streaming tool chunks."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_minisgl import ChatMiniSGL
from langchain_minisgl._tools import ToolCallStreamSplitter, parse_tool_calls
from pydantic import BaseModel

from minisgl_backend.chat.grammar import CALL_SUFFIX, call_prefix


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
    _, ids, _, prompt = chat._prepare(history, None, {"tools": [_openai(add)]})
    text = chat.engine.tokenizer.decode(ids)
    assert prompt.tool_names == {"add"} and prompt.reply_tool is None
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


def test_a_response_format_reply_streams_its_arguments_as_content():
    """The forced call of a response_format's tool is the reply: its arguments stream out as they
    come (all but a tail that may be the closing `}` and tag), cut or whole; another call stays a call."""
    args = '{"setup": "a}\\n}", "punchline": {"x": [1, {}]}}'
    s, text, emitted = ToolCallStreamSplitter("Joke"), "", ""
    for ch in call_prefix("Joke") + args + CALL_SUFFIX:
        text += ch
        emitted += s.feed(ch)
        body = text[len(call_prefix("Joke")) :] if text.startswith(call_prefix("Joke")) else ""
        assert args.startswith(emitted) and len(body) - len(emitted) <= len(CALL_SUFFIX)
        if len(body) < len(args) and not body.endswith("}"):
            assert emitted == body  # inside the arguments only a brace may be held back
    assert emitted == args
    tail, calls, invalid = s.finish(set())
    assert tail == "" and not calls and not invalid
    cut = call_prefix("Joke") + args[:9]
    assert parse_tool_calls(cut, set(), "Joke") == (args[:9], [], [])  # max_tokens: the JSON so far
    assert parse_tool_calls(call_prefix("Joke")[:5], set(), "Joke") == ("", [], [])
    other = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    s = ToolCallStreamSplitter("Joke")
    assert "".join(s.feed(ch) for ch in other) == ""
    tail, calls, _ = s.finish({"add"})
    assert tail == "" and calls[0]["name"] == "add" and calls[0]["args"] == {"a": 1, "b": 2}


# ------------------------------------------------------------------ logprobs, reasoning, profile, media
def test_per_call_logprobs_land_in_response_metadata(chat):
    m = chat.invoke("Hi", logprobs=True, top_logprobs=2, max_tokens=6, temperature=0)
    content = m.response_metadata["logprobs"]["content"]
    assert len(content) == m.usage_metadata["output_tokens"] == 6
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    # The chosen token is among the alternatives whenever its logprob reaches the top-2.
    assert all(e["logprob"] <= max(t["logprob"] for t in e["top_logprobs"]) for e in content)
    assert "logprobs" not in chat.invoke("Hi", max_tokens=2).response_metadata


def test_image_parts_are_an_error_not_dropped(chat):
    from minisgl_backend import InvalidRequestError

    msg = HumanMessage(
        content=[{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    )
    with pytest.raises(InvalidRequestError, match="image_url"):
        chat.invoke([msg])
    assert (
        chat.invoke([HumanMessage(content=[{"type": "text", "text": "Hi"}])], max_tokens=2).content
        is not None
    )


@pytest.mark.parametrize(
    "text, answer, thought",
    [
        ("<think>plan it</think>\n\nThe answer.", "The answer.", "plan it"),
        ("  <think>\nstep 1\n</think>42", "42", "step 1"),
        ("<think>cut before the end", "", "cut before the end"),
        ("No thinking here.", "No thinking here.", None),
        ("An answer with <think> later", "An answer with <think> later", None),
    ],
)
def test_reasoning_is_split_whole_and_streamed(text, answer, thought):
    from minisgl_backend.chat.reasoning import ReasoningStreamSplitter, split_reasoning

    assert split_reasoning(text) == (answer, thought)
    for step in (1, 2, 3, 7):  # any chunking of the stream gives the same split
        splitter = ReasoningStreamSplitter()
        got_answer = got_thought = ""
        for i in range(0, len(text), step):
            a, t = splitter.feed(text[i : i + step])
            got_answer, got_thought = got_answer + a, got_thought + t
        a, t = splitter.finish()
        got_answer, got_thought = got_answer + a, got_thought + t
        assert got_thought.strip() == (thought or "") and got_answer.strip() == answer.strip()


def test_reasoning_option_leaves_a_plain_reply_alone(tiny_model_dir, chat):
    thinker = ChatMiniSGL(
        model=str(tiny_model_dir),
        temperature=0,
        max_tokens=12,
        engine_config={"num_blocks": 512},
        reasoning=True,
    )
    plain = chat.invoke("Hi", temperature=0, max_tokens=12)
    m = thinker.invoke("Hi")
    assert m.content == plain.content and "reasoning_content" not in m.additional_kwargs
    chunks = list(thinker.stream("Hi"))
    assert "".join(c.content for c in chunks) == plain.content


def test_profile_describes_the_model(tiny_model_dir):
    p = ChatMiniSGL(model=str(tiny_model_dir), engine_config={"max_model_len": 96}).profile
    assert p["max_input_tokens"] == 96 and p["tool_calling"] and p["structured_output"]
    assert p["image_inputs"] is False and p["reasoning_output"] is False


def test_n_gives_n_chat_generations_the_first_being_invokes_answer(chat):
    from langchain_core.messages import HumanMessage

    res = chat.generate([[HumanMessage("Hi")]], n=2, max_tokens=6, seed=9)
    gens = res.generations[0]
    assert len(gens) == 2 and gens[0].message.content != gens[1].message.content
    assert [g.message.response_metadata["seed"] for g in gens][0] == 9
    assert chat.invoke("Hi", max_tokens=6, seed=9).content == gens[0].message.content
    assert chat.invoke("Hi", n=2, max_tokens=6, seed=9).content == gens[0].message.content
    with pytest.raises(ValueError, match="n must be 1 when streaming"):
        list(chat.stream("Hi", n=2))
