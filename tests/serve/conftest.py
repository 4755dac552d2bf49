"""Fixtures of the serve tests. Each module that serves over HTTP defines its own `server` fixture
(a BackgroundServer, built with servers.serving) and its AUTH header; `client` talks to that server."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def client(server, request):
    """An httpx client of the module's `server`, sending the module's AUTH header."""
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=server.url, headers=request.module.AUTH, timeout=60) as c:
        yield c
