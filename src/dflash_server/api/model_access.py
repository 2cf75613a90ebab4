"""Which model a request names, and the request's hold on it until its answer ends
(docs/api.md, "Several models").

``run_on_model`` is how every generation route reaches its model: the name (id or alias;
none: the first chat model) picks a configured model, or the request gets OpenAI's 404
``model_not_found`` naming the ids that exist (Anthropic's shape on /v1/messages, by its path).
A model that is not loaded is loaded while the request waits: a streamed request's answer
starts at once and sends keepalives until the model is there, so a failure after that point
(a load that failed, a prompt the model refuses) is the stream's error event.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from dflash_server.api.answers import Shaper, Wire, answer, sse_items
from dflash_server.api.errors import APIError, anthropic_error
from dflash_server.engine.jobs import EngineNotReady, Job
from dflash_server.engine.model_slots import CHAT, EMBEDDINGS, LOADED, Slot
from dflash_server.engine.models import ModelLoadFailed, ModelSet
from dflash_server.engine.worker import Engine
from dflash_server.settings import Settings

# What a route does once its model is there: prepare and submit, for a shaper and a job.
Runner = Callable[[Engine, Settings], Awaitable[tuple[Shaper, Job]]]
ErrorEvent = Callable[[APIError], dict[str, Any]]


def find_model(models: ModelSet, name: str | None, kind: str = CHAT) -> Slot:
    """The configured model ``name`` picks, of ``kind``; else a 404 (unknown) or 400 (another
    kind) naming the models that would do."""
    slot = models.find(name)
    if slot is None:
        ids = ", ".join(repr(s.id) for s in models.slots)
        raise APIError(
            404,
            f"model {name!r} is not served here; available: {ids}",
            param="model",
            code="model_not_found",
        )
    if slot.spec.kind != kind:
        fit = ", ".join(repr(s.id) for s in models.slots if s.spec.kind == kind) or "none"
        what = "an embeddings model" if kind == EMBEDDINGS else "a chat model"
        raise APIError(
            400,
            f"model {slot.id!r} is {'an embeddings' if slot.spec.kind == EMBEDDINGS else 'a chat'}"
            f" model; this endpoint needs {what} (here: {fit})",
            param="model",
            code="model_not_supported",
        )
    return slot


def model_settings(slot: Slot, settings: Settings) -> Settings:
    """The settings a model is served with (its own from the models file, else the server's)."""
    config = slot.spec.config
    return config if isinstance(config, Settings) else settings


async def wait_for(models: ModelSet, slot: Slot, seen: int, request: Request | None) -> None:
    """Until the model is loaded (several models), as an ``APIError`` when it cannot be."""
    if not models.multi:
        return  # the one model: prepare answers 503 while it loads
    try:
        await models.wait_loaded(slot, seen, request.is_disconnected if request else None)
    except ModelLoadFailed as exc:
        raise APIError(500, str(exc), param="model", code="model_load_failed") from exc
    except EngineNotReady as exc:
        raise APIError(503, str(exc), code="model_not_ready", headers={"Retry-After": "5"}) from exc


async def run_on_model(
    models: ModelSet,
    name: str | None,
    request: Request,
    settings: Settings,
    *,
    stream: bool,
    wire: Wire,
    error_event: ErrorEvent,
    run: Runner,
    headers: dict[str, str] | None = None,
) -> Response:
    """The answer of a generation request on the model ``name`` picks (see the module doc)."""
    slot = find_model(models, name)
    seen = models.lease(slot)
    held = [True]

    def release() -> None:  # once, whichever way the answer ends
        if held.pop() if held else False:
            models.release(slot)

    try:
        if stream and models.multi and slot.state != LOADED:
            return _deferred(models, slot, seen, settings, wire, error_event, run, release, headers)
        await wait_for(models, slot, seen, request)
        engine = slot.engine
        if engine is None:  # unloaded again in between cannot happen while held
            raise APIError(503, f"model {slot.id!r} is not loaded", code="model_not_ready")
        shaper, job = await run(engine, model_settings(slot, settings))
        return await answer(shaper, job, stream, request, settings, headers, on_end=release)
    except BaseException:
        release()
        raise


def _deferred(
    models: ModelSet,
    slot: Slot,
    seen: int,
    settings: Settings,
    wire: Wire,
    error_event: ErrorEvent,
    run: Runner,
    release: Callable[[], None],
    headers: dict[str, str] | None,
) -> Response:
    """A stream that starts now and waits for its model with keepalives (``/health`` shows
    the load's progress meanwhile)."""

    async def items() -> AsyncGenerator[Any, None]:
        try:
            try:
                await wait_for(models, slot, seen, None)
                engine = slot.engine
                if engine is None:
                    raise APIError(503, f"model {slot.id!r} is not loaded", code="model_not_ready")
                shaper, job = await run(engine, model_settings(slot, settings))
            except APIError as exc:
                yield wire.item(error_event(exc))
                if wire.done is not None:
                    yield wire.done
                return
            async with aclosing(sse_items(shaper, job, settings.stream_interval)) as events:
                async for item in events:
                    yield item
        finally:
            release()

    return EventSourceResponse(
        items(),
        ping=settings.keepalive,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | (headers or {}),
        ping_message_factory=wire.ping_event if wire.ping is not None else None,
        background=BackgroundTask(release),  # also when the stream never started
    )


def openai_error_event(exc: APIError) -> dict[str, Any]:
    return exc.body()


def anthropic_error_event(exc: APIError) -> dict[str, Any]:
    return anthropic_error(exc.status, exc.anthropic_message())


def responses_error_event(exc: APIError) -> dict[str, Any]:
    return {"type": "error", "sequence_number": 0, **exc.body()["error"]}
