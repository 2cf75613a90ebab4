"""HTTP routes, each one shape: parse (FastAPI), prepare (request -> generation), submit (a
job for the engine), answer (the job's events through the protocol's shaper, answers.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dflash_server.api.answers import answer
from dflash_server.api.anthropic import CountTokensRequest, MessagesRequest
from dflash_server.api.anthropic import to_chat as anthropic_chat
from dflash_server.api.anthropic_events import MessageShaper
from dflash_server.api.deps import EngineDep, MetricsDep, ResponsesDep, SettingsDep
from dflash_server.api.errors import APIError
from dflash_server.api.fields import (
    CHAT_SPEC,
    COMPLETION_SPEC,
    MESSAGES_SPEC,
    RESPONSES_SPEC,
    ignored_fields,
)
from dflash_server.api.openai_events import ChatShaper, TextShaper
from dflash_server.api.openai_responses import PASSED_ON as RESPONSES_PASSED_ON
from dflash_server.api.openai_responses import ResponsesRequest, conversation, prepare_response
from dflash_server.api.openai_responses_events import ResponseShaper
from dflash_server.api.openai_responses_tools import ignored_tools_header, response_tools
from dflash_server.api.prepare import (
    Prepared,
    check_model,
    prepare_chat,
    prepare_completion,
    render_messages,
)
from dflash_server.api.types import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    extensions,
)
from dflash_server.engine.jobs import EngineNotReady, Job, QueueFull
from dflash_server.engine.kv_budget import KVBudgetExceeded
from dflash_server.engine.worker import Engine
from dflash_server.generation.sampling import SERVED_FIELDS
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
    engine: EngineDep,
    metrics: MetricsDep,
) -> Response:
    headers = ignored_fields(body, CHAT_SPEC, request)
    prepared = await prepare_chat(body, settings, engine)
    job = _submit(engine, metrics, prepared, "chat")
    shaper = ChatShaper(prepared, _tokenizer(engine))
    return await answer(shaper, job, prepared.stream, request, settings, headers)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    settings: SettingsDep,
    engine: EngineDep,
    metrics: MetricsDep,
) -> Response:
    headers = ignored_fields(body, COMPLETION_SPEC, request)
    prepared = await prepare_completion(body, settings, engine)
    job = _submit(engine, metrics, prepared, "completions")
    return await answer(TextShaper(prepared), job, prepared.stream, request, settings, headers)


@router.post("/v1/messages")
async def messages(
    body: MessagesRequest,
    request: Request,
    settings: SettingsDep,
    engine: EngineDep,
    metrics: MetricsDep,
) -> Response:
    """Anthropic Messages (see api/anthropic.py)."""
    headers = ignored_fields(body, MESSAGES_SPEC, request, extensions(MessagesRequest))
    prepared = await prepare_chat(anthropic_chat(body), settings, engine)
    job = _submit(engine, metrics, prepared, "messages")
    shaper = MessageShaper(prepared, _tokenizer(engine), body.omit_thinking)
    return await answer(shaper, job, prepared.stream, request, settings, headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(
    body: CountTokensRequest, request: Request, settings: SettingsDep, engine: EngineDep
) -> JSONResponse:
    headers = ignored_fields(body, MESSAGES_SPEC, request, extensions(CountTokensRequest))
    chat = await render_messages(anthropic_chat(body), settings, engine)
    return JSONResponse({"input_tokens": len(chat.prompt.tokens)}, headers=headers)


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
    headers = ignored_fields(body, RESPONSES_SPEC, request, RESPONSES_PASSED_ON)
    tools = response_tools(body.tools)
    so_far = conversation(store, body, tools)
    prepared, so_far = await prepare_response(body, so_far, tools, settings, engine)
    job = _submit(engine, metrics, prepared, "responses")
    shaper = ResponseShaper(prepared, _tokenizer(engine), body, tools, store, so_far)
    headers |= ignored_tools_header(tools)
    return await answer(shaper, job, prepared.stream, request, settings, headers)


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
    served = engine.served
    context = served.summary.context_length if served is not None else None
    card: dict[str, Any] = {
        "id": settings.model_id,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "dflash-server",
        "context_length": context,
        "max_model_len": context,
        "max_input_tokens": context,
    }
    if served is not None:  # known once loaded
        images = served.summary.vision
        card["capabilities"] = ["completion", "chat", "tools", *(["vision"] if images else [])]
        card["modalities"] = {"input": ["text", *(["image"] if images else [])], "output": ["text"]}
    return card


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
async def health(settings: SettingsDep, engine: EngineDep) -> JSONResponse:
    """200 when ready, 503 while loading or after a failed load; the body says which."""
    summary = engine.served.summary.as_dict() if engine.served is not None else {}
    body = {
        "status": engine.state,
        "models": [settings.model_id],
        "target": settings.target,
        "draft": settings.draft,
        "block_size": summary.get("block_size"),
        "draft_family": summary.get("draft_family"),
        "context_length": summary.get("context_length"),
        "vision": summary.get("vision", False),
        "max_images": settings.max_images,
        "max_image_pixels": settings.max_image_pixels,
        "queue_depth": engine.queue_depth,
        "batching": engine.batching,
        "active_rows": engine.active_rows,
        "max_queue": engine.max_queue,
        "prefix_cache": engine.prefix_cache.stats() if engine.prefix_cache else None,
        "kv_memory": engine.kv_memory,
        "defaults": request_defaults(settings),
    }
    if engine.error:
        body["error"] = engine.error
    return JSONResponse(body, status_code=200 if engine.state == "ready" else 503)
