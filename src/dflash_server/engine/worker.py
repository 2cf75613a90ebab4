"""The engine: one worker thread owns every MLX call (loading and generation).

Scheduling: requests wait in a bounded FIFO; up to ``max_active`` of them generate at once, each
as a ``Row`` of the engine's rows: a ``BatchDecoder`` (``batching="batched"``: every running
request advances in one target pass per round, short new prompts prefill together, a long one
one chunk per round) or ``LoneRows`` (``"interleave"``: each request cycles alone, one cycle or
prompt chunk per round). The engine owns the round (``rounds.py``: admit in order under the KV
budget, drop cancelled requests, one ``step`` of the running streams, each response its
request's events); here are its lifecycle (load, unload, stop, abort) and the event-loop side
(submit, status). Outputs are those of a lone run either way, and a short request finishes
while a long one is still running.
The asyncio side only submits jobs and reads their events; a job can be cancelled from the
event loop and stops at the next round. With the target sharded over several machines, a
``lockstep`` (``engine/lockstep.py``) sends each round's decisions to the other ranks before
the step, and a lost rank ends every request with a 503 (``abort``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from dflash_server.engine.allocator import trim
from dflash_server.engine.distributed import RankLost
from dflash_server.engine.jobs import EngineNotReady, Failed, Job, QueueFull
from dflash_server.engine.kv_budget import KVBudgetExceeded, KVLedger, build_ledger, positions
from dflash_server.engine.loader import LoadedModels, ModelLoadError, make_batch
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.rounds import Rounds
from dflash_server.engine.runs import Run
from dflash_server.engine.streams import RowStreams, Streams
from dflash_server.engine.summary import ServedModel
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.pauses import pause
from dflash_server.generation.speculative import LoneRows

if TYPE_CHECKING:
    from dflash_server.engine.lockstep import Leader

log = logging.getLogger("dflash_server")
SHUTDOWN = "server is shutting down"
# "interleave": each request cycles alone, one after another; "batched": all running requests
# advance in one target pass per round (generation/batch.py).
BATCHING = ("interleave", "batched")

LoaderFn = Callable[[], LoadedModels]
# The running requests on the loaded models; by default ``RowStreams`` (tests: a double).
StreamsFn = Callable[[LoadedModels], Streams]


class Engine:
    """Owns the worker thread, the resident models, the wait queue and the active requests."""

    def __init__(
        self,
        loader: LoaderFn,
        *,
        max_queue: int = 8,
        max_active: int | None = 1,
        prefill_step_size: int = 2048,
        streams: StreamsFn | None = None,
        on_fatal: Callable[[str], None] | None = None,
        on_ready: Callable[[], None] | None = None,
        prefix_cache: PrefixCache | None = None,
        batching: str = "batched",
        max_verify: int | None = None,
        on_pass: Callable[[int, int], None] | None = None,
        lockstep: Leader | None = None,
        kv: KVQuant | None = None,
        max_kv_memory: int | None = None,
        managed: bool = False,
        cond: threading.Condition | None = None,
        kv_default_cap: int | None = None,
    ) -> None:
        """``managed``: one of several models, driven by ``engine/models.py``'s worker (no
        thread of its own; ``cond`` is that worker's, so a submission wakes it);
        ``kv_default_cap``: with no ``max_kv_memory``, the KV budget is one request at the
        context length, at most this (None: the one-model default)."""
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        if lockstep is not None and (batching != "batched" or streams is not None):
            raise ValueError("ranks run in lockstep only with batching='batched'")
        self.lockstep = lockstep
        self.batching, self.max_verify = batching, max_verify
        self.kv = kv  # quantized attention KV for every request (None: full precision)
        self.batch: BatchDecoder | None = None  # "batched": the running rows, after loading
        self.rows: BatchDecoder | LoneRows = LoneRows()  # the rows requests decode on
        self.streams: Streams | None = None  # what each round steps, after loading
        self.rounds: Rounds | None = None  # the round's bookkeeping, after loading
        self.on_pass = on_pass  # each batched pass: (rows, verified positions)
        self._loader = loader
        self.prefix_cache = prefix_cache
        self._streams = streams
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
        self.served: ServedModel | None = None  # what the API sees of the models, once loaded
        # Shared with ``rounds`` (kept, never replaced): the waiting jobs and the running ones.
        self._pending: collections.deque[Job] = collections.deque()
        self._active: list[Run] = []
        self.managed, self._kv_default_cap = managed, kv_default_cap
        self._cond = cond or threading.Condition()
        self._held = contextlib.ExitStack()  # a managed engine's wired limit, while loaded
        self._stopping = False
        self._draining = False
        self._aborted = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="dflash-engine", daemon=True)

    # ----- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker (it loads the models first); calling it again does nothing (nor
        does it for a managed engine: its models' worker drives it)."""
        if self._thread.ident is None and not self.managed:
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
            pending = list(self._pending)
            self._pending.clear()
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

    def output_room(self, prompt_tokens: int) -> int | None:
        """The most tokens a request with this prompt may produce within the KV budget (None:
        no budget; 0 or less: the prompt alone does not fit)."""
        return None if self.ledger is None else self.ledger.room(prompt_tokens)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise EngineNotReady / KVBudgetExceeded / QueueFull without
        queueing it."""
        if self.state != "ready":
            raise EngineNotReady(self.error or "models are still loading")
        with self._cond:
            if self._stopping or self._draining or self.rounds is None:
                raise EngineNotReady(SHUTDOWN)
            mean_job_s = self.rounds.mean_job_s
            if (
                self.ledger is not None
                and (need := self.ledger.alone(positions(job.request))) > self.ledger.budget
            ):
                raise KVBudgetExceeded(need, self.ledger.budget, max(1, round(mean_job_s)))
            waits = len(self._pending) + len(self._active)
            if waits >= self.max_active + self.max_queue:
                rounds = waits / self.max_active
                raise QueueFull(max(1, min(300, round(rounds * mean_job_s))))
            job.on_cancel(lambda: self._discard(job))
            self._pending.append(job)
            self._cond.notify()

    def _discard(self, job: Job) -> None:
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)

    # ----- worker thread ---------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            self._main()
        finally:  # the thread's MLX state holds Python objects: freed now, not as the interpreter
            mx.clear_streams()  # exits (docs/development.md, "MLX on other threads")

    def _main(self) -> None:
        if not self.load():
            return
        assert self.models is not None and self.rounds is not None
        try:
            with self.models.pair.wired.held():  # for the engine's lifetime
                while self.rounds.play():
                    trim(idle=not self.has_work)  # freed memory back to the system
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
            self.teardown()

    def load(self) -> bool:
        """Load the models and get ready to admit requests (on the worker thread); False when
        loading failed (``error`` says why)."""
        try:
            self.models = self._loader()
            if self.kv is not None:
                self.kv.check_model(self.models.pair.model)
        except (ModelLoadError, ValueError) as exc:
            self._fail(str(exc))
            return False
        except Exception as exc:
            log.exception("model loading failed")
            self._fail(f"model loading failed: {exc}")
            return False
        pause()  # with several models, the others run a pass here (generation/pauses.py)
        if self.batching == "batched":
            self.batch = self.rows = make_batch(self.models, self.max_verify, self.kv)
            pause()
        self.streams = (self._streams or self._row_streams)(self.models)
        if self._auto_active:
            supported = self.batch.costs.rows_supported() if self.batch and self.batch.costs else 4
            self.max_active = max(4, supported)
            log.info("max_active: %d requests at once", self.max_active)
        prefix = self.prefix_cache.budget if self.prefix_cache is not None else 0
        padded = self.batching == "batched"
        self.ledger = build_ledger(
            self.models, self._max_kv_memory, prefix, padded=padded, kv=self.kv,
            default_cap=self._kv_default_cap,
        )  # fmt: skip
        self.served = self.models.served
        heartbeat = self.lockstep.heartbeat_s if self.lockstep is not None else None
        self.rounds = Rounds(
            self.models.pair, self.streams, cond=self._cond, pending=self._pending,
            active=self._active, stopping=lambda: self._stopping, max_active=self.max_active,
            ledger=self.ledger, batch=self.batch, on_pass=self.on_pass, heartbeat_s=heartbeat,
        )  # fmt: skip
        if self.managed:
            self._held.enter_context(self.models.pair.wired.held())
        self.state = "ready"
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready()
        return True

    def teardown(self) -> None:
        """Every open stream gets a final event; the prefix cache is closed."""
        if self.rounds is not None:  # shutdown: every open stream gets a final event
            self.rounds.end_all(SHUTDOWN, 503, "server_shutdown")
        if self.prefix_cache is not None:
            self.prefix_cache.close()

    @property
    def has_work(self) -> bool:
        """Requests wait or run (a managed engine's worker asks before each round)."""
        with self._cond:
            return bool(self._pending or self._active)

    @property
    def weight_bytes(self) -> int:
        """What its loaded weights take (0 before loading)."""
        return self.models.weight_bytes if self.models is not None else 0

    def round_once(self) -> None:
        """A managed engine's round: admit, drop cancelled requests, one step (no waiting)."""
        if self.state == "ready" and self.has_work and self.rounds is not None:
            self.rounds.play(wait=False)

    def unload(self) -> None:
        """Free a managed engine's models (on the worker, once it holds no request): its
        prefix cache is closed, its wired limit released; it cannot be loaded again."""
        with self._cond:
            self._stopping = True
            pending = list(self._pending)
            self._pending.clear()
        for job in pending:  # none when the models' worker unloads it: it is idle
            job.emit(Failed(SHUTDOWN, 503, "server_shutdown"))
        self.teardown()
        self._held.close()
        self.models = self.served = self.ledger = self.streams = self.batch = self.rounds = None
        self.rows = LoneRows()
        self.state = "unloaded"

    def _row_streams(self, models: LoadedModels) -> Streams:
        """Each request a ``Generation`` on the loaded pair, its row one of ``rows``."""
        return RowStreams(
            models.pair, self.rows, prefill_step_size=self.prefill_step_size,
            prefix=self.prefix_cache, kv=self.kv, lockstep=self.lockstep,
        )  # fmt: skip

    def _fail(self, message: str) -> None:
        self.state, self.error = "error", message
        self._ready.set()
        if self._on_fatal is not None:
            self._on_fatal(message)
