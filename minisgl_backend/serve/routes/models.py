"""/v1/models: the one model this server serves."""

from __future__ import annotations

from minisgl_backend.serve.backend import public_model_ref
from minisgl_backend.serve.responses import ModelCard, ModelList
from minisgl_backend.serve.state import AppState, ServerState, keyed_router

router = keyed_router()


def _card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=public_model_ref(state.backend.model_ref),
        max_model_len=state.backend.max_model_len,
    )


@router.get("/v1/models")
async def models(state: AppState) -> ModelList:
    return ModelList(data=[_card(state)])


@router.get("/v1/models/{model_id:path}")
async def model_info(model_id: str, state: AppState) -> ModelCard:
    state.check_model(model_id)
    return _card(state)
