"""The LangChain examples in examples/ run offline on the embedded model and do what they claim."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import langchain_minisgl
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def _drain():
    yield
    for cfg in langchain_minisgl.running_configs():
        eng = langchain_minisgl._engines.get_engine(cfg)
        assert eng.drain(timeout=60, flush_cache=True)["FREE"] == eng.num_blocks
    langchain_minisgl.close_all()


def test_lcel_chain_answers_each_question():
    answers = _load("langchain_lcel_chain").main(("France", "Japan"))
    assert "Paris" in answers[0] and "Tokyo" in answers[1]


def test_streaming_chat_streams_many_chunks():
    pieces = _load("langchain_streaming_chat").main()
    assert len([p for p in pieces if p]) > 3 and "".join(pieces).strip()


def test_agent_loop_calls_the_tool_feeds_the_result_back_and_answers():
    messages = _load("langchain_agent").main()["messages"]
    human, call, result, answer = messages  # exactly one round trip through the tool
    assert isinstance(human, HumanMessage)
    assert isinstance(call, AIMessage) and [c["name"] for c in call.tool_calls] == ["get_weather"]
    assert "paris" in call.tool_calls[0]["args"]["city"].lower()
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    assert "sunny" in result.content
    assert isinstance(answer, AIMessage) and not answer.tool_calls and answer.text.strip()
