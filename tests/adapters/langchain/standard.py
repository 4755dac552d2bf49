"""What the two runs of LangChain's standard chat-model integration suite share: ChatMiniSGL in process
(test_lc_standard.py) and ChatOpenAI against `minisgl serve` (test_lc_serve_standard.py), both on the
embedded SmolLM2 (bf16, greedy): the capabilities they declare and the same model-quality xfails."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel

# Greedy, and room for a whole forced tool call: one cut by max_tokens cannot parse, constrained or not.
GREEDY = {"max_tokens": 64, "temperature": 0}

_WRONG_ARG = (
    "SmolLM2-135M fills magic_function's argument with a wrong value "
    "(greedy: input=100 for the asked 3); "
    "the forced call itself is valid (grammar-constrained) - see test_lc_chat.py for that guarantee"
)
_CUT_PUNCHLINE = (
    "SmolLM2-135M keeps writing inside the 'punchline' string until max_tokens=64 cuts the "
    "(grammar-valid) call, so it cannot parse"
)


def assert_drained(engine: Any) -> None:
    """Every request of the suite finished or aborted, every KV block reclaimed."""
    counts = engine.drain(timeout=60, flush_cache=True)
    assert counts["running"] == counts["waiting"] == 0 and counts["FREE"] == engine.num_blocks


class SmolLM2Integration:
    """Mixin, listed before ChatModelIntegrationTests: tool choice and JSON mode are supported (the
    grammar guarantees well-formed calls); the xfails below are model-quality limits of a 135M model,
    not adapter defects: the values, or the decision to call, are the model's."""

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.mark.xfail(reason=_WRONG_ARG, strict=False)
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=_WRONG_ARG, strict=False)
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(
        reason="with tool_choice='auto' SmolLM2-135M answers in prose instead of calling get_weather "
        "(measured with 4 tool-prompt variants, with and without a few-shot example); the forced-call "
        "agent loop is covered by examples/langchain_agent.py and its test",
        strict=False,
    )
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason=f"with 'punchline' optional, {_CUT_PUNCHLINE}",
        strict=False,
    )
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(
        reason="with the schema given as a dict (the test's second half; the pydantic-class half parses) "
        f"and the amx family's bf16 attention rounding greedy decoding that way, {_CUT_PUNCHLINE}",
        strict=False,
    )
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(
        reason="json_mode constrains the output to *a* JSON object, not to the schema: greedy SmolLM2-135M "
        "adds a third key beside setup/punchline where the kernels round it that way (seen with the native "
        "CPU kernels' bf16 rounding and with prefix-cache state); the JSON itself is grammar-valid",
        strict=False,
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)
