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
from tests.adapters.langchain.standard import GREEDY, SmolLM2Integration, assert_drained  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier: the standard suite against a server of the embedded model

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
    assert_drained(engine)
    engine.close()


class TestChatOpenAIOverMiniSGL(SmolLM2Integration, ChatModelIntegrationTests):
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
            **GREEDY,
            "stream_usage": True,
            "http_async_client": httpx.AsyncClient(timeout=300),
        }
