"""LangChain's standard chat-model suites against ChatMiniSGL on the embedded SmolLM2 (bf16)."""

from __future__ import annotations

from typing import Any

import langchain_minisgl
import pytest
from langchain_core.language_models import BaseChatModel
from langchain_minisgl import ChatMiniSGL
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from tests.adapters.langchain.standard import GREEDY, SmolLM2Integration, assert_drained

pytestmark = pytest.mark.slow  # slow tier: the standard suites on the embedded model

ENGINE = {"model": "smollm2-135m-instruct", "engine_config": {"dtype": "bfloat16"}}
PARAMS = {**ENGINE, **GREEDY}


@pytest.fixture(scope="module", autouse=True)
def _engines():
    yield
    for cfg in langchain_minisgl.running_configs():
        assert_drained(langchain_minisgl._engines.get_engine(cfg))
    langchain_minisgl.close_all()


class TestChatMiniSGLUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatMiniSGL

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # An in-process engine has no API key; ChatMiniSGL rejects unknown fields instead of dropping them.
        params = dict(super().standard_chat_model_params)
        params.pop("api_key", None)
        return params

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return ENGINE  # the suite sets temperature/max_tokens itself and tests overriding them


class TestChatMiniSGLIntegration(SmolLM2Integration, ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatMiniSGL

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return PARAMS
