"""HTTP routes, each one shape: parse (FastAPI), prepare (request -> generation), submit (a
job for the engine), answer (the job's events through the protocol's shaper, answers.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dflash_server.api.answers import Shaper
from dflash_server.api.anthropic import CountTokensRequest, MessagesRequest
from dflash_server.api.anthropic import to_chat as anthropic_chat
from dflash_server.api.anthropic_events import MessageShaper
from dflash_server.api.deps import MetricsDep, ModelsDep, ResponsesDep, SettingsDep
from dflash_server.api.errors import APIError
from dflash_server.api.fields import (
    CHAT_SPEC,
    COMPLETION_SPEC,
    MESSAGES_SPEC,
    RESPONSES_SPEC,
    ignored_fields,
)
from dflash_server.api.model_access import (
    anthropic_error_event,
    find_model,
    model_settings,
    openai_error_event,
    responses_error_event,
    run_on_model,
    wait_for,
)
from dflash_server.api.openai_events import ChatShaper, TextShaper
from dflash_server.api.openai_responses import PASSED_ON as RESPONSES_PASSED_ON
from dflash_server.api.openai_responses import ResponsesRequest, conversation, prepare_response
from dflash_server.api.openai_responses_events import ResponseShaper
from dflash_server.api.openai_responses_tools import ignored_tools_header, response_tools
from dflash_server.api.prepare import Prepared, prepare_chat, prepare_completion, render_messages
from dflash_server.api.types import ChatCompletionRequest, CompletionRequest, extensions
from dflash_server.engine.jobs import EngineNotReady, Job, QueueFull
from dflash_server.engine.kv_budget import KVBudgetExceeded
from dflash_server.engine.worker import Engine
from dflash_server.generation.sampling import SERVED_FIELDS
from dflash_server.settings import Settings

# The API key and the body-size limit are checked before routing, by api/guard.py.
router = APIRouter()
public = APIRouter()


def _submit(
    engine: Engine, metrics: MetricsDep, prepared: Prepared, endpoint: str, model: str
) -> Job:
    if metrics is None:
        job = Job(prepared.request)
    else:
        job = metrics.job(prepared.request, endpoint, model)
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
    except KVBudgetExceeded as exc:  # before any stream starts: the client sees the status
        retry = {"Retry-After": str(exc.retry_after)}
        raise APIError(503, str(exc), code="kv_memory_exceeded", headers=retry) from exc
    return job


def _tokenizer(engine: Engine) -> Any:
    return engine.served.tokenizer if engine.served is not None else None


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    settings: SettingsDep,
    models: ModelsDep,
    metrics: MetricsDep,
) -> Response:
    headers = ignored_fields(body, CHAT_SPEC, request)

    async def run(engine: Engine, own: Settings) -> tuple[Shaper, Job]:
        prepared = await prepare_chat(body, own, engine)
        job = _submit(engine, metrics, prepared, "chat", own.model_id)
        return ChatShaper(prepared, _tokenizer(engine)), job

    return await run_on_model(
        models, body.model, request, settings, stream=bool(body.stream), wire=ChatShaper.wire,
        error_event=openai_error_event, run=run, headers=headers,
    )  # fmt: skip


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    settings: SettingsDep,
    models: ModelsDep,
    metrics: MetricsDep,
) -> Response:
    headers = ignored_fields(body, COMPLETION_SPEC, request)

    async def run(engine: Engine, own: Settings) -> tuple[Shaper, Job]:
        prepared = await prepare_completion(body, own, engine)
        return TextShaper(prepared), _submit(engine, metrics, prepared, "completions", own.model_id)

    return await run_on_model(
        models, body.model, request, settings, stream=bool(body.stream), wire=TextShaper.wire,
        error_event=openai_error_event, run=run, headers=headers,
    )  # fmt: skip


@router.post("/v1/messages")
async def messages(
    body: MessagesRequest,
    request: Request,
    settings: SettingsDep,
    models: ModelsDep,
    metrics: MetricsDep,
) -> Response:
    """Anthropic Messages (see api/anthropic.py)."""
    headers = ignored_fields(body, MESSAGES_SPEC, request, extensions(MessagesRequest))

    async def run(engine: Engine, own: Settings) -> tuple[Shaper, Job]:
        prepared = await prepare_chat(anthropic_chat(body), own, engine)
        job = _submit(engine, metrics, prepared, "messages", own.model_id)
        return MessageShaper(prepared, _tokenizer(engine), body.omit_thinking), job

    return await run_on_model(
        models, body.model, request, settings, stream=bool(body.stream),
        wire=MessageShaper.wire, error_event=anthropic_error_event, run=run, headers=headers,
    )  # fmt: skip


@router.post("/v1/messages/count_tokens")
async def count_tokens(
    body: CountTokensRequest, request: Request, settings: SettingsDep, models: ModelsDep
) -> JSONResponse:
    headers = ignored_fields(body, MESSAGES_SPEC, request, extensions(CountTokensRequest))
    slot = find_model(models, body.model)
    seen = models.lease(slot)
    try:
        await wait_for(models, slot, seen, request)
        engine = slot.engine
        if engine is None:
            raise APIError(503, f"model {slot.id!r} is not loaded", code="model_not_ready")
        own = model_settings(slot, settings)
        chat = await render_messages(anthropic_chat(body), own, engine)
    finally:
        models.release(slot)
    return JSONResponse({"input_tokens": len(chat.prompt.tokens)}, headers=headers)


@router.post("/v1/responses")
async def responses(
    body: ResponsesRequest,
    request: Request,
    settings: SettingsDep,
    models: ModelsDep,
    metrics: MetricsDep,
    store: ResponsesDep,
) -> Response:
    """OpenAI Responses (see api/openai_responses.py)."""
    headers = ignored_fields(body, RESPONSES_SPEC, request, RESPONSES_PASSED_ON)
    tools = response_tools(body.tools)
    so_far = conversation(store, body, tools)
    headers |= ignored_tools_header(tools)

    async def run(engine: Engine, own: Settings) -> tuple[Shaper, Job]:
        prepared, kept = await prepare_response(body, so_far, tools, own, engine)
        job = _submit(engine, metrics, prepared, "responses", own.model_id)
        return ResponseShaper(prepared, _tokenizer(engine), body, tools, store, kept), job

    return await run_on_model(
        models, body.model, request, settings, stream=bool(body.stream),
        wire=ResponseShaper.wire, error_event=responses_error_event, run=run, headers=headers,
    )  # fmt: skip


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, store: ResponsesDep) -> dict[str, Any]:
    found = store.get(response_id)
    if found is None:
        raise APIError(404, f"response {response_id!r} not found", param="response_id")
    return found.response


def request_defaults(settings: Settings) -> dict[str, Any]:
    """What a request gets for the fields it leaves out, so a client (the chat page) can show
    them and send only what its user changed."""
    sampling = {name: getattr(settings, name) for name in SERVED_FIELDS}
    return sampling | {
        "enable_thinking": settings.enable_thinking,
        "max_tokens": settings.max_tokens,
        "block_size": settings.block_size,
        "speculative": settings.speculative,
    }


@public.get("/health")
async def health(settings: SettingsDep, models: ModelsDep) -> JSONResponse:
    """200 when ready, 503 while loading or after a failed load; the body says which (with a
    models file: every model's state and its load's progress, under ``model_states``)."""
    slot = models.find(None)
    own = model_settings(slot, settings) if slot is not None else settings
    engine = slot.engine if slot is not None else None
    summary = engine.served.summary.as_dict() if engine and engine.served is not None else {}
    body = {
        "status": models.state,
        "models": [s.id for s in models.slots] if models.multi else [settings.model_id],
        "target": own.target,
        "draft": own.draft,
        "block_size": summary.get("block_size"),
        "draft_family": summary.get("draft_family"),
        "context_length": summary.get("context_length"),
        "vision": summary.get("vision", False),
        "max_images": own.max_images,
        "max_image_pixels": own.max_image_pixels,
        "queue_depth": models.queue_depth if models.multi else _depth(engine),
        "batching": engine.batching if engine is not None else own.batching,
        "active_rows": engine.active_rows if engine is not None else 0,
        "max_queue": engine.max_queue if engine is not None else own.max_queue,
        "prefix_cache": engine.prefix_cache.stats() if engine and engine.prefix_cache else None,
        "kv_memory": engine.kv_memory if engine is not None else None,
        "defaults": request_defaults(own),
    }
    if models.multi:
        body["model_states"] = [s.describe() for s in models.slots]
        body["model_memory"] = models.memory()
    if models.error:
        body["error"] = models.error
    return JSONResponse(body, status_code=200 if models.state == "ready" else 503)


def _depth(engine: Engine | None) -> int:
    return engine.queue_depth if engine is not None else 0
