"""/metrics: the Prometheus exposition of the engine's (or every replica's) metrics. It needs no API
key, as vLLM's: Prometheus and load-aware routers scrape it without one, and it tells load figures,
no prompt or output."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from minisgl_backend.serve.errors import ERROR_RESPONSES, MappedRoute
from minisgl_backend.serve.state import AppState

router = APIRouter(route_class=MappedRoute, responses=ERROR_RESPONSES)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: AppState) -> PlainTextResponse:
    body, ctype = await state.backend.render_metrics()
    return PlainTextResponse(body, media_type=ctype)
