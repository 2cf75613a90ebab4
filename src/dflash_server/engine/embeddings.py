"""An embedding model on the models' worker: jobs wait in order, and each worker turn runs one
piece of the head job (a batch of short inputs, or one chunk of a long one), so embedding work
runs between generation passes, never beside them and never long
(docs/design.md, "Several models")."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from dflash_server.engine.loader import evaluate_in_pieces
from dflash_server.generation.pauses import off_worker
from dflash_server.models.embedding import CHUNK_TOKENS, EmbeddingModel

log = logging.getLogger("dflash_server")
# Padded tokens one batch of short inputs may hold (its attention is batch x longest^2).
PIECE_TOKENS = 4096


class EmbeddingJob:
    """One request's inputs (token ids), their vectors in input order once done."""

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.vectors: list[np.ndarray] = []
        self.cancelled = False
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[list[np.ndarray]] = self._loop.create_future()
        self._long: tuple[list[Any], int] | None = None  # a long input's cache and position

    async def result(self) -> list[np.ndarray]:
        """The vectors (raises the worker's error, if it failed)."""
        return await self._done

    def finish(self, error: BaseException | None = None) -> None:
        """Hand the result (or ``error``) to the event loop (called on the worker)."""

        def settle() -> None:
            if self._done.done():
                return
            if error is not None:
                self._done.set_exception(error)
            else:
                self._done.set_result(self.vectors)

        self._loop.call_soon_threadsafe(settle)

    def step(self, model: EmbeddingModel) -> bool:
        """Run one piece; True once every input has its vector."""
        start = len(self.vectors)
        tokens = self.inputs[start]
        if len(tokens) > CHUNK_TOKENS:  # alone, one chunk per step
            cache, done = self._long or (model.start_long(), 0)
            end = min(done + CHUNK_TOKENS, len(tokens))
            vector = model.feed(cache, tokens[done:end], last=end == len(tokens))
            self._long = None if vector is not None else (cache, end)
            if vector is not None:
                self.vectors.append(vector)
        else:
            rows = [tokens]
            for more in self.inputs[start + 1 :]:
                widest = max(len(more), *(len(r) for r in rows))
                if len(more) > CHUNK_TOKENS or widest * (len(rows) + 1) > PIECE_TOKENS:
                    break
                rows.append(more)
            self.vectors.extend(model.embed_batch(rows))
        return len(self.vectors) == len(self.inputs)


class Embedder:
    """An embedding model's jobs and the model once loaded; driven by the models' worker."""

    def __init__(self, loader: Callable[[], EmbeddingModel], cond: threading.Condition) -> None:
        self._loader, self._cond = loader, cond
        self.state = "loading"
        self.error: str | None = None
        self.model: EmbeddingModel | None = None
        self._jobs: collections.deque[EmbeddingJob] = collections.deque()
        self.inputs_done = 0

    def load(self) -> bool:
        """Load the model (on the worker; built on a helper thread, its lazily read weights
        evaluated in pieces: other models run between them); False when it failed (``error``
        says why)."""
        try:
            model = off_worker(self._loader)
            evaluate_in_pieces(model.model, what="the embedding model's weights")
            self.model = model
        except Exception as exc:
            log.exception("embedding model loading failed")
            self.state, self.error = "error", f"cannot load the embedding model: {exc}"
            return False
        self.state = "ready"
        return True

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes if self.model is not None else 0

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._jobs)

    @property
    def has_work(self) -> bool:
        return self.queue_depth > 0

    def submit(self, job: EmbeddingJob) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def round_once(self) -> None:
        """One piece of the head job (on the worker)."""
        with self._cond:
            job = self._jobs[0] if self._jobs else None
        if job is None or self.model is None:
            return
        try:
            done = job.cancelled or job.step(self.model)
        except Exception as exc:
            log.exception("embedding failed")
            job.finish(RuntimeError(f"embedding failed: {exc}"))
            done = True
        if done:
            with self._cond:
                self._jobs.popleft()
            if not job.cancelled:
                self.inputs_done += len(job.inputs)
                job.finish()

    def stop(self, message: str) -> None:
        """End every waiting job with ``message``."""
        with self._cond:
            jobs, self._jobs = list(self._jobs), collections.deque()
        for job in jobs:
            job.finish(RuntimeError(message))

    def unload(self) -> None:
        self.stop("the embedding model was unloaded")
        self.model, self.state = None, "unloaded"
