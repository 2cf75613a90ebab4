"""The FastAPI application factory."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from dflash_server.api.errors import install_error_handlers
from dflash_server.api.routes import public, router
from dflash_server.engine.loader import load_models
from dflash_server.engine.worker import Engine
from dflash_server.settings import Settings


def build_engine(settings: Settings) -> Engine:
    """An engine that loads the configured models on its worker thread."""
    loader = partial(
        load_models,
        str(settings.target),
        settings.draft,
        settings.context_length,
    )
    return Engine(
        loader, max_queue=settings.max_queue, prefill_step_size=settings.prefill_step_size
    )


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """Build the app. The engine starts (and loads models) with the app and stops with it."""
    engine = engine or build_engine(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="dflash-server", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.started = int(time.time())
    install_error_handlers(app)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in settings.allowed_origins,
        )
    app.include_router(router)
    app.include_router(public)
    return app
