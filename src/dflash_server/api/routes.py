"""HTTP routes: parse, check auth, delegate to prepare/engine/responses. No logic lives here."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from dflash_server.api.errors import APIError
from dflash_server.api.prepare import Prepared, check_model, prepare_chat, prepare_completion
from dflash_server.api.responses import collect_response, stream_response
from dflash_server.api.types import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from dflash_server.engine.jobs import EngineNotReady, Job, QueueFull
from dflash_server.engine.worker import Engine
from dflash_server.settings import Settings


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _engine(request: Request) -> Engine:
    return request.app.state.engine


# The API key and the body-size limit are checked before routing, by api/guard.py.
router = APIRouter()
public = APIRouter()


def _submit(engine: Engine, prepared: Prepared) -> Job:
    job = Job(prepared.request)
    try:
        engine.submit(job)
    except QueueFull as exc:
        raise APIError(
            429,
            f"server busy: {engine.queue_depth} requests ahead; retry after {exc.retry_after} s",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        ) from exc
    except EngineNotReady as exc:
        raise APIError(503, str(exc), code="model_not_ready", headers={"Retry-After": "5"}) from exc
    return job


async def _respond(request: Request, prepared: Prepared) -> Response:
    engine = _engine(request)
    job = _submit(engine, prepared)
    tokenizer = engine.models.tokenizer if engine.models else None
    if prepared.stream:
        return EventSourceResponse(
            stream_response(prepared, job, tokenizer, _settings(request).stream_interval),
            ping=_settings(request).keepalive,
            sep="\n",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await collect_response(prepared, job, tokenizer, request.is_disconnected)
    if body is None:  # client is gone; nobody reads this
        return Response(status_code=499)
    return JSONResponse(body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    prepared = await prepare_chat(body, _settings(request), _engine(request))
    return await _respond(request, prepared)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    prepared = await prepare_completion(body, _settings(request), _engine(request))
    return await _respond(request, prepared)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    check_model(model_id, _settings(request))
    return _model_card(request)


def _model_card(request: Request) -> dict[str, Any]:
    return {
        "id": _settings(request).model_id,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "dflash-server",
    }


@public.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when ready, 503 while loading or after a failed load; the body says which."""
    engine, settings = _engine(request), _settings(request)
    summary = engine.models.summary if engine.models else {}
    body = {
        "status": engine.state,
        "models": [settings.model_id],
        "target": settings.target,
        "draft": settings.draft,
        "block_size": summary.get("block_size"),
        "context_length": summary.get("context_length"),
        "queue_depth": engine.queue_depth,
        "max_queue": engine.max_queue,
    }
    if engine.error:
        body["error"] = engine.error
    return JSONResponse(body, status_code=200 if engine.state == "ready" else 503)
