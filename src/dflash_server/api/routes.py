"""HTTP routes: parse, delegate to prepare (request -> generation), the engine (jobs) and the
answer shapers (job events -> each protocol's answer). No logic lives here."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from dflash_server.api import anthropic_events, openai_responses_events
from dflash_server.api.anthropic import CountTokensRequest, MessagesRequest
from dflash_server.api.anthropic import to_chat as anthropic_chat
from dflash_server.api.deps import EngineDep, MetricsDep, ResponsesDep, SettingsDep
from dflash_server.api.errors import APIError
from dflash_server.api.openai_events import collect_response, stream_response
from dflash_server.api.openai_responses import (
    ResponsesRequest,
    Stored,
    conversation,
    prepare_response,
)
from dflash_server.api.openai_responses_tools import ignored_tools_header, response_tools
from dflash_server.api.prepare import (
    Prepared,
    check_model,
    prepare_chat,
    prepare_completion,
    render_messages,
)
from dflash_server.api.types import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from dflash_server.engine.jobs import EngineNotReady, Job, QueueFull
from dflash_server.engine.worker import Engine
from dflash_server.settings import Settings

# The API key and the body-size limit are checked before routing, by api/guard.py.
router = APIRouter()
public = APIRouter()


def _submit(engine: Engine, metrics: MetricsDep, prepared: Prepared, endpoint: str) -> Job:
    job = Job(prepared.request) if metrics is None else metrics.job(prepared.request, endpoint)
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


def _tokenizer(engine: Engine) -> Any:
    return engine.models.pair.tokenizer if engine.models else None


def _events(
    settings: Settings, content: Any, headers: dict[str, str] | None = None, **kwargs: Any
) -> EventSourceResponse:
    return EventSourceResponse(
        content,
        ping=settings.keepalive,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | (headers or {}),
        **kwargs,
    )


def _json(body: dict[str, Any] | None) -> Response:
    if body is None:  # client is gone; nobody reads this
        return Response(status_code=499)
    return JSONResponse(body)


async def _respond(
    request: Request,
    settings: Settings,
    engine: Engine,
    metrics: MetricsDep,
    prepared: Prepared,
    endpoint: str,
) -> Response:
    job = _submit(engine, metrics, prepared, endpoint)
    tokenizer = _tokenizer(engine)
    if prepared.stream:
        stream = stream_response(prepared, job, tokenizer, settings.stream_interval)
        return _events(settings, stream)
    return _json(await collect_response(prepared, job, tokenizer, request.is_disconnected))


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    settings: SettingsDep,
    engine: EngineDep,
    metrics: MetricsDep,
) -> Response:
    prepared = await prepare_chat(body, settings, engine)
    return await _respond(request, settings, engine, metrics, prepared, "chat")


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    settings: SettingsDep,
    engine: EngineDep,
    metrics: MetricsDep,
) -> Response:
    prepared = await prepare_completion(body, settings, engine)
    return await _respond(request, settings, engine, metrics, prepared, "completions")


@router.post("/v1/messages")
async def messages(
    body: MessagesRequest,
    request: Request,
    settings: SettingsDep,
    engine: EngineDep,
    metrics: MetricsDep,
) -> Response:
    """Anthropic Messages (see api/anthropic.py)."""
    prepared = await prepare_chat(anthropic_chat(body), settings, engine)
    job = _submit(engine, metrics, prepared, "messages")
    tokenizer, omit = _tokenizer(engine), body.omit_thinking
    if prepared.stream:
        interval = settings.stream_interval
        stream = anthropic_events.stream_messages(prepared, job, tokenizer, interval, omit)
        return _events(settings, stream, ping_message_factory=anthropic_events.ping)
    return _json(
        await anthropic_events.collect_message(
            prepared, job, tokenizer, request.is_disconnected, omit
        )
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(
    body: CountTokensRequest, settings: SettingsDep, engine: EngineDep
) -> dict[str, int]:
    chat = await render_messages(anthropic_chat(body), settings, engine)
    return {"input_tokens": len(chat.prompt.tokens)}


@router.post("/v1/responses")
async def responses(
    body: ResponsesRequest,
    request: Request,
    settings: SettingsDep,
    engine: EngineDep,
    metrics: MetricsDep,
    store: ResponsesDep,
) -> Response:
    """OpenAI Responses (see api/openai_responses.py)."""
    tools = response_tools(body.tools)
    so_far = conversation(store, body, tools)
    prepared, so_far = await prepare_response(body, so_far, tools, settings, engine)
    job = _submit(engine, metrics, prepared, "responses")
    run = openai_responses_events.ResponseRun(prepared, job, _tokenizer(engine), body, tools)
    headers = ignored_tools_header(tools)

    def keep() -> None:
        if body.store is not False and run.final is not None:
            answer = run.shaper.assistant_message()
            store.put(run.final["id"], Stored(run.final, [*so_far, answer]))

    if prepared.stream:
        events = openai_responses_events.stream_events(run, settings.stream_interval, keep)
        return _events(settings, events, headers=headers)
    if not await openai_responses_events.collect(run, request.is_disconnected):
        return Response(status_code=499)
    keep()
    return JSONResponse(run.final, headers=headers)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, store: ResponsesDep) -> dict[str, Any]:
    found = store.get(response_id)
    if found is None:
        raise APIError(404, f"response {response_id!r} not found", param="response_id")
    return found.response


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request, settings: SettingsDep, engine: EngineDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(request, settings, engine)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(
    model_id: str, request: Request, settings: SettingsDep, engine: EngineDep
) -> dict[str, Any]:
    check_model(model_id, settings)
    return _model_card(request, settings, engine)


def _model_card(request: Request, settings: Settings, engine: Engine) -> dict[str, Any]:
    models = engine.models
    context = models.summary.context_length if models is not None else None
    return {
        "id": settings.model_id,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "dflash-server",
        "context_length": context,
        "max_model_len": context,
        "max_input_tokens": context,
    }


@public.get("/health")
async def health(settings: SettingsDep, engine: EngineDep) -> JSONResponse:
    """200 when ready, 503 while loading or after a failed load; the body says which."""
    summary = engine.models.summary.as_dict() if engine.models else {}
    body = {
        "status": engine.state,
        "models": [settings.model_id],
        "target": settings.target,
        "draft": settings.draft,
        "block_size": summary.get("block_size"),
        "draft_family": summary.get("draft_family"),
        "context_length": summary.get("context_length"),
        "queue_depth": engine.queue_depth,
        "batching": engine.batching,
        "active_rows": engine.active_rows,
        "max_queue": engine.max_queue,
        "prefix_cache": engine.prefix_cache.stats() if engine.prefix_cache else None,
    }
    if engine.error:
        body["error"] = engine.error
    return JSONResponse(body, status_code=200 if engine.state == "ready" else 503)
