"""The engine: one worker thread owns every MLX call (loading and generation).

Scheduling: requests wait in a bounded FIFO; up to ``max_active`` of them generate at once, each
as a ``Row`` of the engine's rows: a ``BatchDecoder`` (``batching="batched"``: every running
request advances in one target pass per round, short new prompts prefill together, a long one
one chunk per round) or ``LoneRows`` (``"interleave"``: each request cycles alone, one cycle or
prompt chunk per round). Admission is in order, while the KV budget holds the head's
reservation (``kv_budget.py``; alone it always fits: one that never could was refused at
``submit``). The engine owns the round: admit, drop cancelled requests, one
``step`` of the rows, then each commit becomes its request's text events. Outputs are those of
a lone run either way, and a short request finishes while a long one is still running.
The asyncio side only submits jobs and reads their events; a job can be cancelled from the
event loop and stops at the next round. With the target sharded over several machines, a
``lockstep`` (``engine/lockstep.py``) sends each round's decisions to the other ranks before
the step, and a lost rank ends every request with a 503 (``abort``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import mlx.core as mx

from dflash_server.chat.logprobs import TokenTexts
from dflash_server.engine.distributed import RankLost
from dflash_server.engine.jobs import EngineNotReady, Event, Failed, Job, QueueFull
from dflash_server.engine.kv_budget import KVBudgetExceeded, KVLedger, build_ledger, positions
from dflash_server.engine.loader import LoadedModels, ModelLoadError, make_batch
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.runs import DONE, Run
from dflash_server.generation.batch import BatchDecoder, Outcome
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.request import GenerationRequest
from dflash_server.generation.row import Row
from dflash_server.generation.speculative import LoneRows
from dflash_server.generation.stream import Generation, GenerationResponse

if TYPE_CHECKING:
    from dflash_server.engine.lockstep import Leader

log = logging.getLogger("dflash_server")
SHUTDOWN = "server is shutting down"
# "interleave": each request cycles alone, one after another; "batched": all running requests
# advance in one target pass per round (generation/batch.py).
BATCHING = ("interleave", "batched")

# A test double for a request's generation on the resident models: its responses, one per
# round (the first: the prefill's); it replaces the rows.
GenerateFn = Callable[[LoadedModels, GenerationRequest], Iterator[GenerationResponse]]
LoaderFn = Callable[[], LoadedModels]


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
        on_ready: Callable[[], None] | None = None,
        prefix_cache: PrefixCache | None = None,
        batching: str = "batched",
        max_verify: int | None = None,
        on_pass: Callable[[int, int], None] | None = None,
        lockstep: Leader | None = None,
        kv: KVQuant | None = None,
        max_kv_memory: int | None = None,
    ) -> None:
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        if lockstep is not None and (batching != "batched" or generate is not None):
            raise ValueError("ranks run in lockstep only with batching='batched'")
        self.lockstep = lockstep
        self.batching, self.max_verify = batching, max_verify
        self.kv = kv  # quantized attention KV for every request (None: full precision)
        self.batch: BatchDecoder | None = None  # "batched": the running rows, after loading
        self.rows: BatchDecoder | LoneRows = LoneRows()  # what each round steps
        self._by_row: dict[Row, Run] = {}
        self.on_pass = on_pass  # each batched pass: (rows, verified positions)
        self._loader = loader
        self.prefix_cache = prefix_cache
        self._generate = generate
        self._on_fatal = on_fatal
        self._on_ready = on_ready  # once requests are admitted (after every load-time measurement)
        self.max_queue = max_queue
        # None: decided at load (batched: the rows a pass supports, at least 4; else 4).
        self._auto_active = max_active is None
        self.max_active = 4 if max_active is None else max(1, max_active)
        self.prefill_step_size = prefill_step_size
        self._max_kv_memory = max_kv_memory  # bytes; 0: no budget; None: the machine's default
        self.ledger: KVLedger | None = None  # the KV budget's reservations, once loaded
        self.state = "loading"
        self.error: str | None = None
        self.models: LoadedModels | None = None
        self._pending: collections.deque[Job] = collections.deque()
        self._active: list[Run] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False
        self._aborted = False
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
        current cycle first), so every open stream still gets its last event. A worker still
        loading holds no job and cannot be interrupted inside MLX: it is not waited for.
        """
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        for job in pending:
            job.cancel()
            job.emit(Failed(SHUTDOWN, 503, "server_shutdown"))
        worker = self._thread
        current = worker is threading.current_thread()
        if worker.is_alive() and not self.loading and not current and not self._aborted:
            worker.join(timeout)
            if worker.is_alive() and self.lockstep is not None:  # in a collective with a lost rank
                self.abort(SHUTDOWN, "server_shutdown")

    def abort(self, message: str, code: str = "rank_lost") -> None:
        """End everything now with a 503 (another rank was lost, or is stuck at shutdown):
        waiting and running requests get their final event, new ones are refused, then
        ``on_fatal`` runs. Safe from any thread: the worker may be stuck inside MLX, so nothing
        here waits for it."""
        with self._cond:
            if self._aborted:
                return
            self._aborted = self._stopping = True
            jobs = [*self._pending, *(run.job for run in self._active)]
            self._pending.clear()
            self._active.clear()
            self._cond.notify_all()
        log.error("%s", message)
        for job in jobs:
            job.emit(Failed(message, 503, code))
        self._fail(message)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loading ended (either way); True when ready."""
        self._ready.wait(timeout)
        return self.state == "ready"

    @property
    def loading(self) -> bool:
        """The worker is loading the models or measuring their costs (inside MLX)."""
        return self.state == "loading" and self._thread.is_alive()

    @property
    def stuck(self) -> bool:
        """The worker outlived an abort: stuck inside MLX (a collective with a lost rank)."""
        return self._aborted and self._thread.is_alive()

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
    def rank_memory(self) -> list[tuple[int, int]]:
        """Each rank's (active, peak) MLX memory in bytes as of the last round (none alone)."""
        return list(self.lockstep.memory) if self.lockstep is not None else []

    @property
    def active_rows(self) -> int:
        """Requests running as rows of the batched pass (0 when interleaving)."""
        return len(self.batch.rows) if self.batch is not None else 0

    @property
    def kv_memory(self) -> dict[str, int] | None:
        """The KV budget and what the running requests reserve of it (None: no budget)."""
        with self._cond:
            if self.ledger is None:
                return None
            return {"in_use_bytes": self.ledger.in_use, "budget_bytes": self.ledger.budget}

    def submit(self, job: Job) -> None:
        """Queue a job, or raise EngineNotReady / KVBudgetExceeded / QueueFull without
        queueing it."""
        if self.state != "ready":
            raise EngineNotReady(self.error or "models are still loading")
        with self._cond:
            if self._stopping or self._draining:
                raise EngineNotReady(SHUTDOWN)
            if (
                self.ledger is not None
                and (need := self.ledger.alone(positions(job.request))) > self.ledger.budget
            ):
                raise KVBudgetExceeded(need, self.ledger.budget, max(1, round(self._mean_job_s)))
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
            if self.kv is not None:
                self.kv.check_model(self.models.pair.model)
        except (ModelLoadError, ValueError) as exc:
            self._fail(str(exc))
            return
        except Exception as exc:
            log.exception("model loading failed")
            self._fail(f"model loading failed: {exc}")
            return
        if self.batching == "batched":
            self.batch = self.rows = make_batch(self.models, self.max_verify, self.kv)
        if self._auto_active:
            supported = self.batch.costs.rows_supported() if self.batch and self.batch.costs else 4
            self.max_active = max(4, supported)
            log.info("max_active: %d requests at once", self.max_active)
        prefix = self.prefix_cache.budget if self.prefix_cache is not None else 0
        padded = self.batching == "batched"
        self.ledger = build_ledger(
            self.models, self._max_kv_memory, prefix, padded=padded, kv=self.kv
        )
        self.state = "ready"
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready()
        try:
            with self.models.pair.wired.held():  # for the engine's lifetime
                while self._round():
                    pass
            if self.lockstep is not None and not self._aborted:
                self.lockstep.close()  # the other ranks exit with this one
        except RankLost as exc:
            self.abort(str(exc))
        except Exception as exc:
            if self.lockstep is None:
                raise
            # The other ranks cannot skip a round that failed here: stop them all, loudly.
            log.exception("the engine's round failed")
            self.abort(f"the engine's round failed ({exc}): restart every rank")
        finally:
            for run in list(self._active):  # shutdown: every open stream gets a final event
                run.job.emit(Failed(SHUTDOWN, 503, "server_shutdown"))
                self._close(run)
            if self.prefix_cache is not None:
                self.prefix_cache.close()

    def _round(self) -> bool:
        """Admit waiting jobs up to ``max_active``, drop cancelled ones, then one step of the
        rows (and of each test double's generator); each outcome goes to its request."""
        heartbeat = self.lockstep.heartbeat_s if self.lockstep is not None else None
        with self._cond:
            while not self._pending and not self._active and not self._stopping:
                if not self._cond.wait(heartbeat) and heartbeat is not None:
                    break  # idle: the round still runs, so the other ranks hear from this one
            if self._stopping:
                return False
            admitted: list[Job] = []
            while self._pending and len(self._active) + len(admitted) < self.max_active:
                head, busy = self._pending[0], bool(self._active or admitted)
                if self.ledger is not None and not self.ledger.admit(
                    head, positions(head.request), busy
                ):
                    break  # in order: the head waits for memory, and the ones behind it too
                admitted.append(self._pending.popleft())
        for job in admitted:
            run = self._start(job)
            with self._cond:
                if run is not None:
                    self._active.append(run)
                elif self.ledger is not None:
                    self.ledger.release(job)
        for run in list(self._active):
            if self._stopping:
                return False
            if run.job.cancelled:
                log.info("request cancelled after %d tokens", run.produced)
                self._end(run, Failed("request cancelled"))
            elif run.gen is not None:
                self._end(run, run.step())
        if self.lockstep is not None or self.rows.busy:
            passes = self.batch.passes if self.batch is not None else 0
            for row, outcome in self._step().items():
                run = self._by_row[row]
                self._end(run, run.feed(outcome))
            if self.on_pass is not None and self.batch is not None and self.batch.passes > passes:
                self.on_pass(*self.batch.last_pass)
        return True

    def _step(self) -> dict[Row, Outcome]:
        if self.lockstep is not None:
            assert self.batch is not None
            return self.lockstep.step(self.batch)  # the round's decisions go to every rank
        return self.rows.step()

    def _end(self, run: Run, final: Event | None) -> None:
        """Once a run has its final event: free its slot, then tell the client (its next
        request must fit)."""
        if final is None:
            return
        event = run.finished() if final is DONE else final
        self._close(run)
        run.job.emit(event)

    def _fail(self, message: str) -> None:
        self.state, self.error = "error", message
        self._ready.set()
        if self._on_fatal is not None:
            self._on_fatal(message)

    def _start(self, job: Job) -> Run | None:
        """Make the job's run: a row of the engine's rows (its prefill starts at this round's
        step), or the test double's generator."""
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
            if self._generate is not None:
                return Run(job, texts, gen=self._generate(m, job.request))
            generation = Generation(
                m.pair, job.request, prefill_step_size=self.prefill_step_size,
                prefix=self.prefix_cache, kv=self.kv,
            )  # fmt: skip
            request = job.request
            self.rows.add(generation.row, generation.prompt, request.max_tokens,
                          generation.eos_ids)  # fmt: skip
            if self.lockstep is not None:
                self.lockstep.added(generation.row, request)
        except Exception as exc:
            log.exception("generation failed")
            job.emit(Failed(f"generation failed: {exc}"))
            return None
        run = Run(job, texts, generation=generation)
        self._by_row[generation.row] = run
        return run

    def _close(self, run: Run) -> None:
        """Drop an ended run; its row leaves the rows (caches freed now, not at GC)."""
        with self._cond:
            if run in self._active:
                self._active.remove(run)
            if self.ledger is not None:
                self.ledger.release(run.job)
        try:
            if run.generation is not None:
                self._by_row.pop(run.generation.row, None)
                if self.lockstep is not None:
                    self.lockstep.removed(run.generation.row)
                self.rows.remove(run.generation.row)
            close = getattr(run.gen, "close", None)  # a generator's: frees its caches now
            if close is not None:
                close()
        except Exception:
            log.exception("closing a generation failed")
        elapsed = time.monotonic() - (run.job.started or run.job.created)
        self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed
