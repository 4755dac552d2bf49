"""LangChain adapter tests: async tests run under pytest-asyncio without a project-wide asyncio_mode.

langchain-tests' standard suites define unmarked `async def` tests (they expect asyncio_mode=auto).
This wrapper marks the coroutine tests collected in this directory as soon as they are created, before
pytest-asyncio (whose wrapper sits outside this one) decides whether to run them on an event loop, so
the repository's pytest settings stay untouched for every other test file.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: object) -> Generator[None, Any, None]:
    outcome = yield
    result = outcome.get_result()
    nodes = result if isinstance(result, list) else [result]
    for node in nodes:
        if isinstance(node, pytest.Function) and inspect.iscoroutinefunction(getattr(node, "obj", None)):
            node.add_marker(pytest.mark.asyncio)


@pytest.fixture(scope="session")
def close_drained():
    """Teardown for a module's model: its engine drains with every KV block FREE, then all close."""

    def close(model: Any) -> None:
        import langchain_minisgl

        eng = model.engine
        counts = eng.drain(timeout=60, flush_cache=True)
        assert counts["running"] == counts["waiting"] == 0 and counts["FREE"] == eng.num_blocks
        langchain_minisgl.close_all()

    return close
