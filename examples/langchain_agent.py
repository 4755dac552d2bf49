"""A LangChain agent with one tool on the embedded model, offline: tool called, result fed back, answer.

    python examples/langchain_agent.py

A 135M model does not decide on its own to call a tool (tool_choice="auto" gets a prose answer), so a
small middleware schedules the choice: the first model call must call a tool (decoding is constrained
to the tool's JSON schema, so the call always parses), the call after a tool result must answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langchain_minisgl import ChatMiniSGL


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 22 degrees Celsius in {city}."


@wrap_model_call
def tool_first_then_answer(
    request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
) -> ModelResponse:
    has_result = any(isinstance(m, ToolMessage) for m in request.messages)
    return handler(request.override(tool_choice="none" if has_result else "any"))


def main(question: str = "What is the weather in Paris?") -> dict[str, Any]:
    model = ChatMiniSGL(temperature=0, max_tokens=64, engine_config={"dtype": "bfloat16"})
    agent = create_agent(
        model,
        tools=[get_weather],
        middleware=[tool_first_then_answer],
        system_prompt="You are a helpful weather assistant.",
    )
    result = agent.invoke({"messages": [{"role": "user", "content": question}]})
    for message in result["messages"]:
        message.pretty_print()
    return result


if __name__ == "__main__":
    main()
