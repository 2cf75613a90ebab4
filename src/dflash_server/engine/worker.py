"""The engine: one worker thread owns every MLX call (loading and generation).

Scheduling: requests wait in a bounded FIFO; up to ``max_active`` of them generate at once, and
the worker advances each active request by one DFlash cycle per round (round robin). Every
request keeps its own caches inside its ``stream_generate`` generator, so interleaving changes
no request's tokens, and a short request finishes while a long one is still running. A new
request's prefill runs as its first step (chunked by ``prefill_step_size``).
The asyncio side only submits jobs and reads their events; a job can be cancelled from the
event loop and stops at its next step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dflash_server.engine.jobs import (
    EngineNotReady,
    Event,
    Failed,
    Finished,
    GenerationParams,
    Job,
    QueueFull,
    TextChunk,
)
from dflash_server.engine.loader import LoadedModels, ModelLoadError
from dflash_server.engine.logprobs import TokenTexts, token_logprobs

__all__ = [
    "Engine",
    "EngineNotReady",
    "Event",
    "Failed",
    "Finished",
    "GenerateFn",
    "GenerationParams",
    "Job",
    "QueueFull",
    "TextChunk",
]

log = logging.getLogger("dflash_server")
SHUTDOWN = "server is shutting down"


GenerateFn = Callable[..., Iterator[Any]]
LoaderFn = Callable[[], LoadedModels]


def _default_generate(*args: Any, **kwargs: Any) -> Iterator[Any]:
    from dflash_server import stream_generate

    return stream_generate(*args, **kwargs)


class _Run:
    """An admitted job on the worker thread: its generator and what its final event needs."""

    def __init__(self, job: Job, gen: Iterator[Any], texts: TokenTexts | None) -> None:
        self.job, self.gen, self.texts = job, gen, texts
        self.last: Any = None
        self.produced = 0

    def step(self) -> Event | None:
        """Advance one cycle (the first is the prefill); return the final event once it ends."""
        job = self.job
        if job.cancelled:
            log.info("request cancelled after %d tokens", self.produced)
            return Failed("request cancelled")
        try:
            response = next(self.gen)
        except StopIteration:
            return _DONE
        except Exception as exc:
            log.exception("generation failed")
            return Failed(f"generation failed: {exc}")
        self.last = response
        self.produced += len(response.tokens)
        if response.text or response.tokens:
            lps = None
            if self.texts is not None:
                lps = token_logprobs(
                    self.texts, response.tokens, response.logprobs, response.top_logprobs
                )
            job.emit(TextChunk(response.text, len(response.tokens), lps))
        return _DONE if response.finish_reason is not None else None


_DONE = Finished("", 0, 0)  # sentinel: the generator ended; the engine builds the real event


class Engine:
    """Owns the worker thread, the resident models, the wait queue and the active requests."""

    def __init__(
        self,
        loader: LoaderFn,
        *,
        max_queue: int = 8,
        max_active: int = 1,
        prefill_step_size: int = 2048,
        generate: GenerateFn | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self._loader = loader
        self._generate = generate or _default_generate
        self._on_fatal = on_fatal
        self.max_queue = max_queue
        self.max_active = max(1, max_active)
        self.prefill_step_size = prefill_step_size
        self.state = "loading"
        self.error: str | None = None
        self.models: LoadedModels | None = None
        self._pending: collections.deque[Job] = collections.deque()
        self._active: list[_Run] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False
        self._ready = threading.Event()
        self._mean_job_s = 5.0  # running estimate for Retry-After
        self._token_texts: TokenTexts | None = None  # token names for logprobs, cached
        self._thread = threading.Thread(target=self._main, name="dflash-engine", daemon=True)

    # ----- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker (it loads the models first); calling it again does nothing."""
        if self._thread.ident is None:
            self._thread.start()

    def drain(self) -> None:
        """Refuse new requests (503) while the ones already admitted go on (graceful shutdown)."""
        with self._cond:
            self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """End every job with a final 'shutting down' event and join the worker.

        Waiting jobs end at once; active ones at the worker's next step (it finishes its
        current cycle first), so every open stream still gets its last event.
        """
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        for job in pending:
            job._cancelled.set()
            job.emit(Failed(SHUTDOWN, 503, "server_shutdown"))
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loading ended (either way); True when ready."""
        self._ready.wait(timeout)
        return self.state == "ready"

    @property
    def queue_depth(self) -> int:
        """Requests waiting plus the ones generating."""
        with self._cond:
            return len(self._pending) + len(self._active)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._active)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise EngineNotReady / QueueFull without queueing it."""
        if self.state != "ready":
            raise EngineNotReady(self.error or "models are still loading")
        with self._cond:
            if self._stopping or self._draining:
                raise EngineNotReady(SHUTDOWN)
            waits = len(self._pending) + len(self._active)
            if waits >= self.max_active + self.max_queue:
                rounds = waits / self.max_active
                raise QueueFull(max(1, min(300, round(rounds * self._mean_job_s))))
            job._engine = self
            self._pending.append(job)
            self._cond.notify()

    def _discard(self, job: Job) -> None:
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)

    # ----- worker thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.models = self._loader()
        except ModelLoadError as exc:
            self._fail(str(exc))
            return
        except Exception as exc:
            log.exception("model loading failed")
            self._fail(f"model loading failed: {exc}")
            return
        self.state = "ready"
        self._ready.set()
        try:
            while self._round():
                pass
        finally:
            for run in list(self._active):  # shutdown: every open stream gets a final event
                run.job.emit(Failed(SHUTDOWN, 503, "server_shutdown"))
                self._close(run)

    def _round(self) -> bool:
        """Admit waiting jobs up to ``max_active``, then step each active one once."""
        with self._cond:
            while not self._pending and not self._active and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return False
            admitted = []
            while self._pending and len(self._active) + len(admitted) < self.max_active:
                admitted.append(self._pending.popleft())
        for job in admitted:
            run = self._start(job)
            if run is not None:
                with self._cond:
                    self._active.append(run)
        for run in list(self._active):
            if self._stopping:
                return False
            final = run.step()
            if final is not None:
                run.job.emit(self._finished(run) if final is _DONE else final)
                self._close(run)
        return True

    def _fail(self, message: str) -> None:
        self.state, self.error = "error", message
        self._ready.set()
        if self._on_fatal is not None:
            self._on_fatal(message)

    def _start(self, job: Job) -> _Run | None:
        """Create the job's generator (no MLX work yet: its first step is the prefill)."""
        if job.cancelled:
            return None
        assert self.models is not None
        m = self.models
        job.started = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):  # prompt text only ever at debug level
            log.debug("request prompt: %r", m.tokenizer.decode(job.prompt)[-2000:])
        if not self._active:
            import mlx.core as mx

            mx.reset_peak_memory()  # the peak of the busy period that starts here
        extra: dict[str, Any] = {}
        if job.params.grammar is not None:
            from dflash_server.engine.structured import make_constraint

            try:  # compiled per request (ms); checked at admission, so failure is unexpected
                extra["constraint"] = make_constraint(
                    m.tokenizer, job.params.grammar, job.params.think_end
                )
            except Exception as exc:
                log.exception("grammar setup failed")
                job.emit(Failed(f"structured output setup failed: {exc}"))
                return None
        texts = None
        if job.params.logprobs is not None:
            texts = self._token_texts or TokenTexts(m.tokenizer)
            self._token_texts = texts
        try:
            gen = self._generate(
                m.model,
                m.draft if job.params.speculative else None,
                m.tokenizer,
                job.prompt,
                prefill_step_size=self.prefill_step_size,
                **job.params.generate_kwargs(),
                **extra,
            )
        except Exception as exc:
            log.exception("generation failed")
            job.emit(Failed(f"generation failed: {exc}"))
            return None
        return _Run(job, gen, texts)

    def _close(self, run: _Run) -> None:
        """Drop a finished run; closing its generator frees its caches now, not at GC."""
        with self._cond:
            if run in self._active:
                self._active.remove(run)
        try:
            run.gen.close()
        except Exception:
            log.exception("closing a generation failed")
        elapsed = time.monotonic() - (run.job.started or run.job.created)
        self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed

    def _finished(self, run: _Run) -> Finished:
        assert self.models is not None
        job, last = run.job, run.last
        speculative = job.params.speculative and self.models.draft is not None
        stats: dict[str, Any] = {"speculative": speculative}
        if last is None:  # the generator yielded nothing at all
            return Finished("length", len(job.prompt), 0, stats)
        spec = getattr(last, "stats", None)
        if spec is not None and hasattr(spec, "as_dict"):
            stats.update(spec.as_dict())
        drafted, accepted = stats.get("drafted"), stats.get("accepted")
        if drafted:
            stats["acceptance_rate"] = round(accepted / drafted, 4)
        if speculative:
            stats.setdefault("block_size", job.params.block_size or self.models.draft_block_size)
        stats.update(
            prompt_tps=round(float(last.prompt_tps), 2),
            generation_tps=round(float(last.generation_tps), 2),
            peak_memory_gb=round(float(last.peak_memory), 3),
            queue_wait_s=round((job.started or job.created) - job.created, 3),
        )
        done = Finished(last.finish_reason or "length", len(job.prompt), run.produced, stats)
        log.info(
            "request: %d prompt + %d output tokens (%s), %.1f tok/s, tau %s",
            done.prompt_tokens,
            done.completion_tokens,
            done.finish_reason,
            stats.get("generation_tps", 0.0),
            stats.get("tau", "-") if speculative else "- (plain decoding)",
        )
        return done
