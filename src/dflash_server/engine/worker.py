"""The engine: one worker thread owns every MLX call (loading and generation).

Scheduling: requests wait in a bounded FIFO; up to ``max_active`` of them generate at once, and
the worker advances each active request by one step per round (round robin): a DFlash cycle, or
one prompt chunk (``prefill_step_size`` tokens) of a request still prefilling, so a long prompt
never stalls the other streams for more than a chunk. Every request keeps its own caches inside
its ``stream_generate`` generator, so interleaving changes no request's tokens, and a short
request finishes while a long one is still running. With ``batching="batched"`` the requests
past their prefill run as rows of one ``BatchDecoder`` instead: each round every request's
step reads its row's tokens from the last pass (a new short prompt registers for a prefill),
then one batch step: the waiting short prompts prefilled together in one forward, and one
batched pass (one drafter pass for the drafting rows, one target verify for all); outputs are
still those of a lone run.
The asyncio side only submits jobs and reads their events; a job can be cancelled from the
event loop and stops at its next step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator

import mlx.core as mx

from dflash_server.chat.logprobs import TokenTexts, token_logprobs
from dflash_server.engine.jobs import (
    EngineNotReady,
    Event,
    Failed,
    Finished,
    Job,
    QueueFull,
    RequestTimings,
    TextChunk,
)
from dflash_server.engine.loader import LoadedModels, ModelLoadError
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.request import GenerationRequest
from dflash_server.generation.stream import GenerationResponse, generate

log = logging.getLogger("dflash_server")
SHUTDOWN = "server is shutting down"
# "interleave": each request cycles alone, one after another; "batched": all running requests
# advance in one target pass per round (generation/batch.py).
BATCHING = ("interleave", "batched")

# One request's generation on the resident models: a response per cycle (the first: prefill).
GenerateFn = Callable[[LoadedModels, GenerationRequest], Iterator[GenerationResponse]]
LoaderFn = Callable[[], LoadedModels]


class _Run:
    """An admitted job on the worker thread: its generator and what its final event needs."""

    def __init__(
        self, job: Job, gen: Iterator[GenerationResponse], texts: TokenTexts | None
    ) -> None:
        self.job, self.gen, self.texts = job, gen, texts
        self.last: GenerationResponse | None = None
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
            job.emit(TextChunk(response.text, len(response.tokens), lps, response.sources))
        return _DONE if response.finish_reason is not None else None


_DONE = Finished("", 0, 0)  # sentinel: the generator ended; the engine builds the real event


class Engine:
    """Owns the worker thread, the resident models, the wait queue and the active requests."""

    def __init__(
        self,
        loader: LoaderFn,
        *,
        max_queue: int = 8,
        max_active: int | None = 1,
        prefill_step_size: int = 2048,
        generate: GenerateFn | None = None,
        on_fatal: Callable[[str], None] | None = None,
        prefix_cache: PrefixCache | None = None,
        batching: str = "batched",
        max_verify: int | None = None,
    ) -> None:
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        self.batching, self.max_verify = batching, max_verify
        self.batch: BatchDecoder | None = None  # "batched": the running rows, after loading
        self.on_pass: Callable[[int, int], None] | None = None  # (rows, verified positions)
        self._loader = loader
        self.prefix_cache = prefix_cache
        self._generate = generate or self._run_request
        self._on_fatal = on_fatal
        self.max_queue = max_queue
        # None: decided at load (batched: the rows a pass supports, at least 4; else 4).
        self._auto_active = max_active is None
        self.max_active = 4 if max_active is None else max(1, max_active)
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
            job.cancel()
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

    @property
    def active_rows(self) -> int:
        """Requests running as rows of the batched pass (0 when interleaving)."""
        return len(self.batch.rows) if self.batch is not None else 0

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
            job.on_cancel(lambda: self._discard(job))
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
        if self.batching == "batched":
            self._make_batch()
        if self._auto_active:
            supported = self.batch.costs.rows_supported() if self.batch and self.batch.costs else 4
            self.max_active = max(4, supported)
            log.info("max_active: %d requests at once", self.max_active)
        self.state = "ready"
        self._ready.set()
        try:
            with self.models.pair.wired.held():  # for the engine's lifetime
                while self._round():
                    pass
        finally:
            for run in list(self._active):  # shutdown: every open stream gets a final event
                run.job.emit(Failed(SHUTDOWN, 503, "server_shutdown"))
                self._close(run)
            if self.prefix_cache is not None:
                self.prefix_cache.close()

    def _make_batch(self) -> None:
        """The batch of this pair; with the cycle costs measured at load, its pass costs too
        (from the calibration cache when this pair was measured on this machine before)."""
        from functools import partial

        from dflash_server.generation.batch_budget import PassCosts, measure_pass_costs

        assert self.models is not None
        pair = self.models.pair
        self.batch = BatchDecoder(pair.target, self.max_verify)
        if pair.draft is not None and pair.measured is not None:
            measure = partial(measure_pass_costs, pair.target, pair.draft)
            self.batch.costs = self.models.calibration.fetch("batch", PassCosts, measure)
            log.info("%s", self.batch.costs.describe())

    def _round(self) -> bool:
        """Admit waiting jobs up to ``max_active``, then step each active one once."""
        with self._cond:
            while not self._pending and not self._active and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return False
            admitted: list[Job] = []
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
                # Free the slot before the client hears the end: its next request must fit.
                event = self._finished(run) if final is _DONE else final
                self._close(run)
                run.job.emit(event)
        if self.batch is not None and (self.batch.rows or self.batch.waiting):
            passes = self.batch.passes
            try:  # the waiting prompts' prefill, then one pass for every running row
                self.batch.step()  # each row's step next round reads its tokens
            except Exception:
                log.exception("batched pass failed")  # each of its rows ends with the error
            if self.on_pass is not None and self.batch.passes > passes:
                self.on_pass(*self.batch.last_pass)
        return True

    def _fail(self, message: str) -> None:
        self.state, self.error = "error", message
        self._ready.set()
        if self._on_fatal is not None:
            self._on_fatal(message)

    def _run_request(
        self, models: LoadedModels, request: GenerationRequest
    ) -> Iterator[GenerationResponse]:
        return generate(
            models.pair,
            request,
            prefill_step_size=self.prefill_step_size,
            prefix=self.prefix_cache,
            yield_chunks=True,  # a long prompt prefills between the other streams' cycles
            batch=self.batch,
        )

    def _start(self, job: Job) -> _Run | None:
        """Create the job's generator (no MLX work yet: its first step is the prefill)."""
        if job.cancelled:
            return None
        assert self.models is not None
        m = self.models
        job.started = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):  # prompt text only ever at debug level
            log.debug("request prompt: %r", m.pair.tokenizer.decode(job.request.prompt)[-2000:])
        if not self._active:
            mx.reset_peak_memory()  # the peak of the busy period that starts here
        texts = None
        if job.request.logprobs is not None:
            texts = self._token_texts or TokenTexts(m.pair.tokenizer)
            self._token_texts = texts
        try:
            gen = self._generate(m, job.request)
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
            close = getattr(run.gen, "close", None)  # a generator's: frees its caches now
            if close is not None:
                close()
        except Exception:
            log.exception("closing a generation failed")
        elapsed = time.monotonic() - (run.job.started or run.job.created)
        self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed

    def _finished(self, run: _Run) -> Finished:
        job, last = run.job, run.last
        request = job.request
        prompt_tokens = len(request.prompt)
        done = Finished(
            "length", prompt_tokens, 0, request.speculative, request.block.width, None, None
        )
        if last is None:  # the generator yielded nothing at all
            return done
        done.completion_tokens = run.produced
        done.finish_reason = last.finish_reason or "length"
        done.stop_sequence = last.stop
        done.stats = last.stats
        done.cached_tokens = last.stats.cached_tokens if last.stats is not None else 0
        done.timings = RequestTimings(
            queue_wait_s=round((job.started or job.created) - job.created, 3),
            prompt_tps=round(float(last.prompt_tps), 2),
            generation_tps=round(float(last.generation_tps), 2),
            peak_memory_gb=round(float(last.peak_memory), 3),
        )
        speculation = "plain decoding" + (last.stats.batches() if last.stats is not None else "")
        if (request.speculative or request.block.copies) and last.stats is not None:
            speculation = last.stats.summary()  # tau, block sizes used, plain share, estimate
        log.info(
            "request: %d prompt (%s) + %d output tokens (%s), %.1f tok/s, %s",
            done.prompt_tokens,
            f"prefix cache hit: {done.cached_tokens} reused"
            if done.cached_tokens
            else "prefix cache miss",
            done.completion_tokens,
            done.finish_reason,
            done.timings.generation_tps,
            speculation,
        )
        return done
