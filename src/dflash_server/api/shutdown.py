"""Graceful shutdown: on SIGINT/SIGTERM every in-flight request ends with a final event.

uvicorn alone would wait for open streams and then cancel them mid-stream (no last chunk),
and sse-starlette would cut them at once. Instead: stop listening, refuse new work (503),
let running generations finish for ``grace`` seconds, then end the rest with a
"server is shutting down" error event (503 for non-streamed requests), and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Generator

import uvicorn

from dflash_server.engine.models import ModelSet
from dflash_server.engine.worker import Engine

log = logging.getLogger("dflash_server")


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains the engine before uvicorn's own shutdown runs."""

    def __init__(self, config: uvicorn.Config, engine: Engine | ModelSet, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        # sse-starlette would cancel every stream the moment a signal arrives; the engine
        # ends them itself, each with a final event.
        from sse_starlette.sse import AppStatus

        AppStatus.disable_automatic_graceful_drain()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the signal after its shutdown (exit status 143 / KeyboardInterrupt);
        # the drain above is the whole shutdown, so the process exits 0 instead.
        with super().capture_signals():
            try:
                yield
            finally:
                getattr(self, "_captured_signals", []).clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections from here on
            server.close()
        self.engine.drain()
        deadline = time.monotonic() + self.grace
        if self.engine.queue_depth:
            log.info("shutdown: letting %d request(s) finish", self.engine.queue_depth)
        while self.engine.queue_depth and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.engine.queue_depth:
            log.info("shutdown: ending %d unfinished request(s)", self.engine.queue_depth)
        await asyncio.to_thread(self.engine.stop)  # final events go out; the worker exits
        await super().shutdown(sockets)
