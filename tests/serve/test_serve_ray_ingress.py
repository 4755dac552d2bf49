"""The Ray ingress's app without a Ray cluster: the ingress deployment class built over stand-in
replica handles, for what `minisgl serve --replicas N` passes it (--reasoning-parser) and its drain
(--shutdown-timeout). The replicas themselves run in the slow tier (test_serve_ray.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="--replicas needs Ray Serve (minisgl[ray])")

from minisgl_backend import EngineConfig  # noqa: E402


class _Remote:
    def __init__(self, value):
        self.value = value

    def remote(self, *_args):
        async def call():
            return self.value

        return call()


class _Handle:
    """What the ingress asks of an engine replica's DeploymentHandle while it starts."""

    def __init__(self, tiny_model_dir):
        self.info = _Remote(
            {"model_dir": str(tiny_model_dir), "max_model_len": 256, "vocab_size": 49152, "index": 0}
        )

    def options(self, **_kw):
        return self


def _ingress(tiny_model_dir, **kw):
    from minisgl_backend.serve.ray_ingress import Ingress

    cfg = dataclasses.asdict(EngineConfig(model=str(tiny_model_dir)))
    ingress = Ingress.__new__(Ingress)
    handles = [_Handle(tiny_model_dir), _Handle(tiny_model_dir)]

    async def build():
        await ingress.__init__(cfg, "tiny", None, *handles, **kw)

    asyncio.run(build())
    return ingress


def test_the_ingress_app_gets_the_reasoning_parser(tiny_model_dir):
    assert _ingress(tiny_model_dir, reasoning_parser="deepseek_r1")._app.state.server.reasoning
    assert not _ingress(tiny_model_dir)._app.state.server.reasoning


def test_the_ingress_drain_refuses_new_requests_and_waits_for_those_in_flight(tiny_model_dir):
    """Ingress.drain: new requests get the 503 `shutting_down` with Retry-After; it returns once the
    request in flight ends (0 left), or at its timeout with the count still in flight."""
    app = _ingress(tiny_model_dir)._app
    ingress_drain = app.state.drain

    async def run():
        from minisgl_backend.serve.ray_ingress import Ingress

        self = Ingress.__new__(Ingress)
        self._app = app
        ingress_drain.enter()  # a request in flight
        waiting = asyncio.ensure_future(self.drain(30))
        await asyncio.sleep(0.05)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            r = await c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "shutting_down"
        assert not waiting.done()
        ingress_drain.leave()  # it ends
        assert await asyncio.wait_for(waiting, 10) == 0
        ingress_drain.enter()
        assert await self.drain(0.05) == 1  # one still in flight at the timeout

    asyncio.run(run())


class _Call:
    def __init__(self, waits, left):
        self.waits, self.left = waits, left

    def result(self, timeout_s):
        if self.waits:
            self.waits -= 1
            raise TimeoutError
        return self.left


class _Server:
    def __init__(self, call):
        self.ingress = type("I", (), {"drain": type("D", (), {"remote": staticmethod(lambda t: call)})})()


def test_the_command_waits_for_the_drain_and_a_second_signal_cuts_it_short(caplog):
    from minisgl_backend.serve.ray_app import _drain

    now = threading.Event()
    with caplog.at_level(logging.INFO, logger="minisgl.serve"):
        _drain(_Server(_Call(waits=2, left=1)), 5.0, now)  # polled until the drain ends
    assert "1 requests still in flight after 5 s: aborted" in caplog.text
    now.set()
    call = _Call(waits=10**9, left=0)
    _drain(_Server(call), 5.0, now)  # returns at once
    assert call.waits == 10**9
