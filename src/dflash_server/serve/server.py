"""Serving over HTTP: uvicorn's settings, and ``serve``, which runs the app until shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from dflash_server.api.app import create_app
from dflash_server.api.metrics import Metrics
from dflash_server.api.read_timeout import http_protocol
from dflash_server.api.shutdown import GracefulServer
from dflash_server.engine import allocator
from dflash_server.engine.blas import blas_hint
from dflash_server.engine.models import ModelSet
from dflash_server.engine.worker import Engine
from dflash_server.models_file import ModelEntry
from dflash_server.serve.engine import build_engine
from dflash_server.serve.models import build_models
from dflash_server.settings import Settings

log = logging.getLogger("dflash_server")


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


def _uvicorn_log_config(level: str) -> dict[str, Any]:
    config = {**LOGGING_CONFIG, "loggers": dict(LOGGING_CONFIG["loggers"])}
    config["loggers"]["dflash_server"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


class _Server(GracefulServer):
    """Remembers the first signal, so that Ctrl-C exits 130 as a shell expects (SIGTERM, a
    service manager's stop, exits 0) after the same graceful shutdown."""

    first_signal: int | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.first_signal = self.first_signal or sig
        super().handle_exit(sig, frame)


def serve(
    settings: Settings,
    target_path: str | None,
    draft_path: str | None,
    group: Any = None,
    entries: list[ModelEntry] | None = None,
) -> int:
    """Run uvicorn until shutdown; the engine loads the models on its worker meanwhile (rank 0
    of ``group``, when the target is sharded over several machines). ``entries``: a models
    file's models instead (loaded when asked for)."""
    failure: list[str] = []
    server: _Server | None = None

    def on_fatal(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    if (hint := blas_hint()) is not None:
        log.warning("%s", hint)
    allocator.configure()  # before the worker's and uvicorn's threads
    metrics = Metrics() if settings.metrics else None
    engine: Engine | ModelSet
    if entries is not None:
        engine = build_models(settings, entries, metrics=metrics, on_fatal=on_fatal)
    else:
        engine = build_engine(
            settings,
            target_path=target_path,
            draft_path=draft_path,
            on_fatal=on_fatal,
            metrics=metrics,
            group=group,
        )
    app = create_app(settings, engine, metrics)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=_uvicorn_log_config(settings.log_level),
        log_level=settings.log_level,
        **server_options(settings),
    )
    server = _Server(config, engine, settings.shutdown_timeout)
    sharded = "" if group is None else f", the target sharded over {group.size()} ranks"
    if entries is None:
        log.info("loading %s + %s%s", settings.target, settings.drafter or "no drafter", sharded)
    # uvicorn re-raises Ctrl-C after its graceful shutdown; that is a normal exit here.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if engine.loading:
        # Stopped while loading: the worker is inside MLX and cannot be interrupted, and
        # finalizing the interpreter under it aborts in C++; so the process ends here, at once.
        print("dflash-serve: stopped while loading the models", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(130)
    if failure:
        print(f"dflash-serve: error: {failure[0]}", file=sys.stderr)
        if engine.stuck:  # inside a collective with a lost rank: finalizing would wait for it
            logging.shutdown()
            os._exit(1)
        return 1
    if server.first_signal == signal.SIGINT:
        print("dflash-serve: stopped (Ctrl-C)", file=sys.stderr)
        return 130
    return 0
