"""The probes, which need no API key: /health (and vLLM's /ping, SageMaker's name for it) and
/version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

from fastapi import APIRouter

from minisgl_backend.serve.errors import APIError, ErrorResponse
from minisgl_backend.serve.responses import HealthResponse, VersionResponse
from minisgl_backend.serve.state import AppState

router = APIRouter()


def _package_version() -> str:
    try:
        return dist_version("minisgl")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


VERSION = _package_version()


UNHEALTHY: dict[int | str, dict[str, Any]] = {503: {"model": ErrorResponse}}


@router.get("/health", responses=UNHEALTHY)
@router.get("/ping", responses=UNHEALTHY)
@router.post("/ping", responses=UNHEALTHY)
async def health(state: AppState) -> HealthResponse:
    why = await state.backend.unhealthy()
    if why is not None:
        raise APIError(503, why, "service_unavailable", code="engine_dead")
    return HealthResponse()


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=VERSION)
