"""The engine: one worker thread owns every MLX call (loading and generation).

Requests wait in a bounded FIFO and run one at a time, so target and drafter stay resident and
never race for the accelerator. The asyncio side only submits jobs and reads their events; a job
can be cancelled from the event loop and stops at the generator's next yield (the next cycle).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dflash_server.engine.loader import LoadedModels, ModelLoadError
from dflash_server.engine.logprobs import TokenLogprob, TokenTexts, token_logprobs

log = logging.getLogger("dflash_server")


class QueueFull(Exception):
    """The wait queue is at capacity; ``retry_after`` is a guess in seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("queue full")
        self.retry_after = retry_after


class EngineNotReady(Exception):
    """Models are still loading, or loading failed."""


@dataclass(frozen=True)
class GenerationParams:
    """Everything ``stream_generate`` needs besides the models and the prompt."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    block_size: int | None = None
    speculative: bool = True
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    grammar: str | None = None  # llguidance (lark) grammar for structured output / tool_choice
    think_end: int | None = None  # the grammar starts after this token (reasoning left open)

    def generate_kwargs(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": list(self.stop) or None,
            "seed": self.seed,
            "block_size": self.block_size if self.speculative else None,
            "logprobs": self.logprobs,
        }


@dataclass
class TextChunk:
    """New output text and how many tokens produced it."""

    text: str
    tokens: int
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them


@dataclass
class Finished:
    """The last event of a successful job."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Failed:
    """The last event of a job that raised; ``message`` is safe to show the client."""

    message: str


Event = TextChunk | Finished | Failed


class Job:
    """One generation request: created on the event loop, run on the worker thread."""

    def __init__(self, prompt: list[int], params: GenerationParams) -> None:
        self.prompt = prompt
        self.params = params
        self.created = time.monotonic()
        self.started: float | None = None
        self._loop = asyncio.get_running_loop()
        # Worker appends, event loop drains. The loop is woken only when it may be asleep, so
        # while it is busy sending, new tokens pile up and leave as one merged event.
        self._buffer: collections.deque[Event] = collections.deque()
        self._ready = asyncio.Event()
        self._wake_pending = False
        self._cancelled = threading.Event()
        self._done = False
        self._engine: Engine | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the job: drop it from the queue, or stop generating at the next cycle."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            if self._engine is not None:
                self._engine._discard(self)

    def emit(self, event: Event) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        self._buffer.append(event)  # append first, then look at the flag: no lost wake-up
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._ready.set)

    async def next_events(
        self, timeout: float | None = None, hold_until: float = 0.0
    ) -> list[Event] | None:
        """Wait for at least one event, then take all that are ready (consecutive text merged).

        Returns None on timeout and [] once the final event was already taken. Merging lets a
        slow client receive fewer, larger SSE events instead of falling behind. Once text is
        there, waits until ``hold_until`` (a time.monotonic() value) to gather more with it.
        """
        if self._done:
            return []
        while not self._buffer:
            self._ready.clear()
            self._wake_pending = False  # clear, then re-check the buffer: no lost wake-up
            if self._buffer:
                break
            if timeout is None:
                await self._ready.wait()
            else:
                try:
                    await asyncio.wait_for(self._ready.wait(), timeout)
                except asyncio.TimeoutError:
                    if not self._buffer:
                        return None
        linger = hold_until - time.monotonic()
        if linger > 0 and not isinstance(self._buffer[-1], Finished | Failed):
            await asyncio.sleep(linger)
        events = []
        while self._buffer:
            events.append(self._buffer.popleft())
        merged: list[Event] = []
        for ev in events:
            if isinstance(ev, TextChunk) and merged and isinstance(merged[-1], TextChunk):
                last = merged[-1]
                lps = None if ev.logprobs is None else (last.logprobs or []) + ev.logprobs
                merged[-1] = TextChunk(last.text + ev.text, last.tokens + ev.tokens, lps)
            else:
                merged.append(ev)
            if isinstance(ev, Finished | Failed):
                self._done = True
        return merged


GenerateFn = Callable[..., Iterator[Any]]
LoaderFn = Callable[[], LoadedModels]


def _default_generate(*args: Any, **kwargs: Any) -> Iterator[Any]:
    from dflash_server import stream_generate

    return stream_generate(*args, **kwargs)


class Engine:
    """Owns the worker thread, the resident models and the request queue."""

    def __init__(
        self,
        loader: LoaderFn,
        *,
        max_queue: int = 8,
        prefill_step_size: int = 2048,
        generate: GenerateFn | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self._loader = loader
        self._generate = generate or _default_generate
        self._on_fatal = on_fatal
        self.max_queue = max_queue
        self.prefill_step_size = prefill_step_size
        self.state = "loading"
        self.error: str | None = None
        self.models: LoadedModels | None = None
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._mean_job_s = 5.0  # running estimate for Retry-After
        self._token_texts: TokenTexts | None = None  # token names for logprobs, cached
        self._thread = threading.Thread(target=self._main, name="dflash-engine", daemon=True)

    # ----- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker (it loads the models first); calling it again does nothing."""
        if self._thread.ident is None:
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and join the worker (it finishes its current cycle first)."""
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), collections.deque()
            running = self._running
            self._cond.notify_all()
        for job in pending:
            job._cancelled.set()
            job.emit(Failed("server is shutting down"))
        if running is not None:
            running._cancelled.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loading ended (either way); True when ready."""
        self._ready.wait(timeout)
        return self.state == "ready"

    @property
    def queue_depth(self) -> int:
        """Requests waiting plus the one running."""
        with self._cond:
            return len(self._pending) + (self._running is not None)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise EngineNotReady / QueueFull without queueing it."""
        if self.state != "ready":
            raise EngineNotReady(self.error or "models are still loading")
        with self._cond:
            if self._stopping:
                raise EngineNotReady("server is shutting down")
            waits = len(self._pending) + (self._running is not None)
            if waits > self.max_queue:  # one running plus max_queue waiting
                raise QueueFull(max(1, min(300, round(waits * self._mean_job_s))))
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
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._pending.popleft()
                self._running = job
            try:
                if not job.cancelled:
                    self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _fail(self, message: str) -> None:
        self.state, self.error = "error", message
        self._ready.set()
        if self._on_fatal is not None:
            self._on_fatal(message)

    def _run(self, job: Job) -> None:
        import mlx.core as mx

        assert self.models is not None
        m = self.models
        job.started = time.monotonic()
        draft = m.draft if job.params.speculative else None
        mx.reset_peak_memory()
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
                return
        texts = None
        if job.params.logprobs is not None:
            texts = self._token_texts or TokenTexts(m.tokenizer)
            self._token_texts = texts
        gen = self._generate(
            m.model,
            draft,
            m.tokenizer,
            job.prompt,
            prefill_step_size=self.prefill_step_size,
            **job.params.generate_kwargs(),
            **extra,
        )
        last = None
        produced = 0
        try:
            for response in gen:
                if job.cancelled:
                    log.info("request cancelled after %d tokens", produced)
                    job.emit(Failed("request cancelled"))
                    return
                last = response
                produced += len(response.tokens)
                if response.text or response.tokens:
                    lps = None
                    if texts is not None:
                        lps = token_logprobs(
                            texts, response.tokens, response.logprobs, response.top_logprobs
                        )
                    job.emit(TextChunk(response.text, len(response.tokens), lps))
                if response.finish_reason is not None:
                    break
            done = self._finished(job, last, produced)
            job.emit(done)
            st = done.stats
            log.info(
                "request: %d prompt + %d output tokens (%s), %.1f tok/s, tau %s",
                done.prompt_tokens,
                done.completion_tokens,
                done.finish_reason,
                st.get("generation_tps", 0.0),
                st.get("tau", "-") if st.get("speculative") else "- (plain decoding)",
            )
        except Exception as exc:
            log.exception("generation failed")
            job.emit(Failed(f"generation failed: {exc}"))
        finally:
            gen.close()  # frees the generator's caches now, not at garbage collection
            elapsed = time.monotonic() - job.started
            self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed

    def _finished(self, job: Job, last: Any, produced: int) -> Finished:
        assert self.models is not None
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
        return Finished(last.finish_reason or "length", len(job.prompt), produced, stats)
