"""``/v1/models``: every configured model with OpenAI's fields, its state and kind; and the
operators' ``POST /v1/models/{id}/load`` and ``/unload`` (behind the API key, as all of /v1)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from dflash_server.api.deps import ModelsDep, SettingsDep
from dflash_server.api.errors import APIError
from dflash_server.api.model_access import model_settings, wait_for
from dflash_server.api.types import ModelCard, ModelList
from dflash_server.engine.model_slots import EMBEDDINGS, Slot
from dflash_server.engine.models import ModelSet
from dflash_server.settings import Settings

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)
async def list_models(request: Request, settings: SettingsDep, models: ModelsDep) -> dict[str, Any]:
    cards = [model_card(request, settings, models, slot) for slot in models.slots]
    return {"object": "list", "data": cards}


@router.get(
    "/v1/models/{model_id:path}", response_model=ModelCard, response_model_exclude_none=True
)
async def get_model(
    model_id: str, request: Request, settings: SettingsDep, models: ModelsDep
) -> dict[str, Any]:
    return model_card(request, settings, models, _named(models, model_id))


@router.post("/v1/models/{model_id:path}/load", response_model=ModelCard)
async def load_model(
    model_id: str, request: Request, settings: SettingsDep, models: ModelsDep
) -> dict[str, Any]:
    """Load a model now (an operator warming it up); 200 with its card once loaded."""
    slot = _named(models, model_id)
    seen = models.lease(slot, "asked to (POST /v1/models/{id}/load)")
    try:
        await wait_for(models, slot, seen, request)
    finally:
        models.release(slot)
    return model_card(request, settings, models, slot)


@router.post("/v1/models/{model_id:path}/unload", response_model=ModelCard)
async def unload_model(
    model_id: str, request: Request, settings: SettingsDep, models: ModelsDep
) -> dict[str, Any]:
    """Unload a model now; 409 while requests wait for it or run on it, or when pinned."""
    slot = _named(models, model_id)
    refusal = models.ask_unload(slot)
    if refusal is not None:
        raise APIError(409, refusal, param="model", code="model_busy")
    await models.wait_unloaded(slot)
    return model_card(request, settings, models, slot)


def _named(models: ModelSet, name: str) -> Slot:
    slot = models.find(name)
    if slot is None:
        ids = ", ".join(repr(s.id) for s in models.slots)
        raise APIError(
            404, f"model {name!r} is not served here; available: {ids}", param="model",
            code="model_not_found",
        )  # fmt: skip
    return slot


def model_card(
    request: Request, settings: Settings, models: ModelSet, slot: Slot
) -> dict[str, Any]:
    """OpenAI's model object (id, object, created, owned_by) and what clients read besides:
    the context, capabilities, state and kind."""
    own = model_settings(slot, settings)
    card: dict[str, Any] = {
        "id": slot.id,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "dflash-server",
        "state": slot.state,
        "kind": slot.spec.kind,
    }
    if models.multi:
        card |= {"aliases": list(slot.spec.aliases), "pinned": slot.spec.pinned}
    if slot.spec.kind == EMBEDDINGS:
        embedder = slot.embedder
        if embedder is not None and embedder.model is not None:
            card |= {"dimensions": embedder.model.dimensions, "capabilities": ["embeddings"]}
            context = embedder.model.context_length
            card |= {
                "context_length": context,
                "max_model_len": context,
                "max_input_tokens": context,
            }
        return card
    engine = slot.engine
    served = engine.served if engine is not None else None
    length = served.summary.context_length if served is not None else own.context_length
    card |= {"context_length": length, "max_model_len": length, "max_input_tokens": length}
    if served is not None:  # known once loaded
        images = served.summary.vision
        card["capabilities"] = ["completion", "chat", "tools", *(["vision"] if images else [])]
        card["modalities"] = {"input": ["text", *(["image"] if images else [])], "output": ["text"]}
    return card
