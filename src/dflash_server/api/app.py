"""The FastAPI application factory."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from dflash_server.api.errors import install_error_handlers
from dflash_server.api.guard import RequestGuard
from dflash_server.api.metrics import Metrics, RequestMetrics
from dflash_server.api.metrics import router as metrics_router
from dflash_server.api.openai_responses import ResponseStore
from dflash_server.api.read_timeout import http_protocol
from dflash_server.api.routes import public, router
from dflash_server.api.web import web
from dflash_server.engine.distributed import Channel
from dflash_server.engine.loader import LoadedModels, describe, load_models
from dflash_server.engine.lockstep import Leader
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.prefix_disk import PrefixDisk
from dflash_server.engine.worker import Engine, GenerateFn, LoaderFn
from dflash_server.settings import Settings

log = logging.getLogger("dflash_server")


def build_loader(
    settings: Settings,
    prefix_cache: PrefixCache | None,
    *,
    target_path: str | None = None,
    draft_path: str | None = None,
    group: Any = None,
) -> LoaderFn:
    """What the engine's worker runs first: load the configured models (tensor-sharded over
    ``group``'s ranks when given), log what it got, add the prefix cache's disk tier."""

    def loader() -> LoadedModels:
        models = load_models(
            target_path or str(settings.target),
            draft_path or settings.drafter,
            settings.context_length,
            target_label=settings.target,
            draft_label=settings.drafter,
            draft_window=settings.draft_window,
            suffix_tokens=settings.suffix_tokens,
            suffix_cache_bytes=settings.suffix_cache_bytes,
            calibration_cache=settings.calibration_folder,
            vision=settings.vision,
            group=group,
        )
        for line in describe(models.summary).splitlines():
            log.info("%s", line)
        if models.summary.vision:
            remote = "http(s) URLs too" if settings.allow_remote_images else "data URLs only"
            log.info(
                "images: at most %d per request, resized to at most %d pixels, %s",
                settings.max_images,
                settings.max_image_pixels,
                remote,
            )
        if settings.context_length and settings.context_length > models.summary.context_length:
            log.warning(
                "--context-length %d is above the model's limit: capped to %d",
                settings.context_length,
                models.summary.context_length,
            )
        if prefix_cache is None:
            log.info("prefix cache: off")
        else:
            if settings.prefix_cache_dir:
                folder = Path(settings.prefix_cache_dir).expanduser()
                if group is not None:  # each rank keeps its own shard's entries
                    folder = folder / f"rank{group.rank()}-of-{group.size()}"
                budget = settings.prefix_cache_disk_bytes
                # Snapshots queued for writing add at most a quarter to the RAM tier's memory.
                queued = prefix_cache.budget // 4
                disk = PrefixDisk(folder, budget, models.summary.fingerprint, max_pending=queued)
                prefix_cache.add_disk(disk)
            log.info("prefix cache: %s", prefix_cache.describe())
        return models

    return loader


def prefix_cache_of(settings: Settings) -> PrefixCache | None:
    return PrefixCache(settings.prefix_cache_budget) if settings.prefix_cache else None


def build_engine(
    settings: Settings,
    *,
    target_path: str | None = None,
    draft_path: str | None = None,
    on_fatal: Callable[[str], None] | None = None,
    generate: GenerateFn | None = None,
    metrics: Metrics | None = None,
    group: Any = None,
) -> Engine:
    """An engine that loads the configured models on its worker thread and logs what it got.

    ``target_path``/``draft_path`` are already-downloaded folders (the CLI fetches first);
    ``generate`` replaces ``stream_generate``, for tests; ``metrics`` hears of every batched pass.
    ``group``: the MLX distributed group this is rank 0 of; the other ranks follow its rounds
    (``api/ranks.py``).
    """
    prefix_cache = prefix_cache_of(settings)
    loader = build_loader(
        settings, prefix_cache, target_path=target_path, draft_path=draft_path, group=group
    )

    def ready() -> None:  # the engine calls it once /health says 200, not before
        log.info(
            "ready: serving %r at http://%s:%d/v1", settings.model_id, settings.host, settings.port
        )

    leader = None
    if group is not None:
        leader = Leader(Channel(group), settings.rank_timeout, lambda why: engine.abort(why))
    engine = Engine(
        loader,
        max_queue=settings.max_queue,
        max_active=settings.max_active,
        prefill_step_size=settings.prefill_step_size,
        batching=settings.batching,
        max_verify=settings.max_verify,
        kv=settings.kv_quant,
        generate=generate,
        on_fatal=on_fatal,
        on_ready=ready,
        prefix_cache=prefix_cache,
        on_pass=metrics.observe_pass if metrics is not None else None,
        lockstep=leader,
        max_kv_memory=settings.kv_memory_bytes,
    )
    return engine


def create_app(
    settings: Settings, engine: Engine | None = None, metrics: Metrics | None = None
) -> FastAPI:
    """Build the app. The engine starts (and loads models) with the app and stops with it.

    By default both come from ``settings``; a caller that builds the engine passes the
    ``Metrics`` it gave ``build_engine`` (else /metrics counts no batched passes).
    """
    metrics = (metrics or Metrics()) if settings.metrics else None
    engine = engine or build_engine(settings, metrics=metrics)

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
    app.include_router(public)
    if settings.metrics:
        app.include_router(metrics_router)
    if settings.web:
        app.include_router(web)
    # Outermost: every response, the guard's refusals included, gets its x-request-id.
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    return app


def server_options(settings: Settings) -> dict[str, Any]:
    """The ``uvicorn.Config`` settings the app is served with (the tests' servers too)."""
    return {
        "http": http_protocol(settings.request_read_timeout),  # 408 for slow clients
        # uvicorn's 5 s equals the idle time httpx (the OpenAI and Anthropic SDKs) keeps a
        # pooled connection: a request sent as the server closed it got a reset.
        "timeout_keep_alive": settings.timeout_keep_alive,
        # After the engine's grace period every stream has its final event; a backstop.
        "timeout_graceful_shutdown": int(settings.shutdown_timeout) + 10,
    }
