"""/metrics: the Prometheus exposition of the engine's (or every replica's) metrics."""

from __future__ import annotations

from fastapi.responses import PlainTextResponse

from minisgl_backend.serve.state import AppState, keyed_router

router = keyed_router()


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: AppState) -> PlainTextResponse:
    body, ctype = await state.backend.render_metrics()
    return PlainTextResponse(body, media_type=ctype)
