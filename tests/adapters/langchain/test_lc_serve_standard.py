"""LangChain's standard chat-model integration suite on `ChatOpenAI(base_url=..., api_key=...)`
against `minisgl serve` (embedded SmolLM2, bf16, greedy): the same suite, the same model and the
same model-quality xfails as the in-process ChatMiniSGL run (test_lc_standard.py), no others.

ChatOpenAI's structured output defaults to `method="json_schema"` (a response_format) where
ChatMiniSGL's uses a forced tool call, and its json_mode sends a schema-less json_object: the server
decodes both as a forced call of a tool made from the format, so they pass as ChatMiniSGL's do."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
lco = pytest.importorskip("langchain_openai")

from langchain_core.language_models import BaseChatModel  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from minisgl_backend import Engine, EngineConfig  # noqa: E402
from minisgl_backend.serve import start_in_thread  # noqa: E402

KEY = "sk-lc"
MODEL = "smollm2"
_SERVER: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _server():
    engine = Engine(
        EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16", stats_interval_s=0, num_threads=1)
    )
    srv = start_in_thread(engine, api_key=KEY, model_name=MODEL)
    _SERVER["url"] = srv.url
    yield
    srv.stop()
    counts = engine.drain(timeout=60, flush_cache=True)  # every request finished or aborted, blocks reclaimed
    assert counts["running"] == counts["waiting"] == 0 and counts["FREE"] == engine.num_blocks
    engine.close()


_WRONG_ARG = (
    "SmolLM2-135M fills magic_function's argument with a wrong value; the forced call itself is "
    "valid (grammar-constrained) - the same xfail as the in-process suite"
)


class TestChatOpenAIOverMiniSGL(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return lco.ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Greedy, and room for a whole forced tool call (as in the in-process suite). A fresh async
        # HTTP client per model: langchain-openai otherwise caches one per base_url across tests, and
        # pytest-asyncio gives every test its own event loop ("Event loop is closed").
        import httpx

        return {
            "base_url": f"{_SERVER['url']}/v1",
            "api_key": KEY,
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 64,
            "stream_usage": True,
            "http_async_client": httpx.AsyncClient(timeout=300),
        }

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
        reason="with tool_choice='auto' SmolLM2-135M answers in prose instead of calling "
        "get_weather (the same xfail as the in-process suite)",
        strict=False,
    )
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="SmolLM2-135M keeps writing inside the optional 'punchline' string until "
        "max_tokens=64 cuts the (grammar-valid) call (the same xfail as the in-process suite)",
        strict=False,
    )
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(
        reason="json_mode constrains the output to *a* JSON object, not to the schema: greedy SmolLM2-135M "
        "adds a third key beside setup/punchline where the kernels round it that way (seen with the native "
        "CPU kernels' bf16 rounding and with prefix-cache state); the JSON itself is grammar-valid",
        strict=False,
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)
