"""The probes, which need no API key: /health (and vLLM's /ping, SageMaker's name for it) and
/version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from minisgl_backend.serve.errors import ErrorResponse, error_body
from minisgl_backend.serve.responses import HealthResponse, VersionResponse
from minisgl_backend.serve.state import AppState

router = APIRouter()


def _package_version() -> str:
    try:
        return dist_version("minisgl")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


VERSION = _package_version()


@router.api_route(
    "/health", methods=["GET"], response_model=HealthResponse, responses={503: {"model": ErrorResponse}}
)
@router.get("/ping", response_model=None)
@router.post("/ping", response_model=None)
async def health(state: AppState) -> HealthResponse | JSONResponse:
    why = await state.backend.unhealthy()
    if why is not None:
        return JSONResponse(error_body(why, "service_unavailable", None, "engine_dead").model_dump(), 503)
    return HealthResponse()


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=VERSION)
