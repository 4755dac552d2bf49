"""Fixtures of the serve tests. Each module that serves over HTTP defines its own `server` fixture
(a BackgroundServer, built with servers.serving); `client` talks to it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def client(server):
    """An httpx client of the module's `server`, with the server's API key as bearer token."""
    httpx = pytest.importorskip("httpx")
    headers = {"Authorization": f"Bearer {server.state.api_key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        yield c
