"""The FastAPI application factory."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from dflash_server.api.embeddings import router as embeddings_router
from dflash_server.api.errors import install_error_handlers
from dflash_server.api.guard import RequestGuard
from dflash_server.api.metrics import Metrics, RequestMetrics
from dflash_server.api.metrics import router as metrics_router
from dflash_server.api.models_routes import router as models_router
from dflash_server.api.openai_responses import ResponseStore
from dflash_server.api.routes import public, router
from dflash_server.api.web import web
from dflash_server.engine.model_slots import ModelSpec
from dflash_server.engine.models import ModelSet
from dflash_server.engine.worker import Engine
from dflash_server.models_file import single_entry
from dflash_server.settings import Settings

log = logging.getLogger("dflash_server")


def create_app(
    settings: Settings, engine: Engine | ModelSet, metrics: Metrics | None = None
) -> FastAPI:
    """Build the app over ``engine`` (one model) or a ``ModelSet`` (a models file), which
    starts (and loads models) with the app and stops with it. ``metrics``: the ``Metrics`` the
    engine reports its batched passes to (with ``settings.metrics``; None: a fresh one, which
    counts no batched passes)."""
    metrics = (metrics or Metrics()) if settings.metrics else None
    models = engine if isinstance(engine, ModelSet) else one_model(settings, engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        models.start()
        try:
            yield
        finally:
            models.stop()

    app = FastAPI(title="dflash-server", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = models.single  # the one model's engine (None: several models)
    app.state.models = models
    app.state.started = int(time.time())
    app.state.metrics = metrics
    app.state.responses = ResponseStore(settings.responses_store)
    install_error_handlers(app)
    protected = ("/metrics",) if settings.metrics_auth else ()
    app.add_middleware(
        RequestGuard,
        api_key=settings.api_key,
        max_body=settings.max_request_bytes,
        protected=protected,
        read_timeout=settings.request_read_timeout,
    )
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in settings.allowed_origins,
        )
    app.include_router(router)
    app.include_router(models_router)
    app.include_router(embeddings_router)
    app.include_router(public)
    if settings.metrics:
        app.include_router(metrics_router)
    if settings.web:
        app.include_router(web)
    # Outermost: every response, the guard's refusals included, gets its x-request-id.
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    return app


def one_model(settings: Settings, engine: Engine) -> ModelSet:
    """The one-model server (``--target``) as a set of one: its engine keeps its own thread."""
    entry = single_entry(settings)

    def no_second_engine(_: object) -> Engine:
        raise RuntimeError("the one-model server's engine is never rebuilt")

    spec = ModelSpec(
        entry.id, no_second_engine, aliases=entry.aliases, pinned=True, config=settings
    )
    return ModelSet([spec], single=engine)
