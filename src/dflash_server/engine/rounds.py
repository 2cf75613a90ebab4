"""The engine's round, on its worker thread: admit, drop cancelled requests, one step.

Admission takes waiting jobs in order, up to ``max_active`` running at once, while the KV budget
holds the head's reservation (``kv_budget.py``; alone it always fits: one that never could was
refused at ``submit``). Each admitted job becomes a ``Run`` (``runs.py``) whose stream is one of
the engine's ``Streams`` (``streams.py``); a cancelled one ends with its final event; then one
``step`` of the streams, and each response (or error) becomes its request's events. ``Rounds``
is built whole once the models are loaded (``Engine.load``) and shares the engine's wait queue,
running runs and condition: the event-loop side queues jobs, the worker plays rounds.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable

import mlx.core as mx

from dflash_server.chat.logprobs import TokenTexts
from dflash_server.engine.jobs import Event, Failed, Job
from dflash_server.engine.kv_budget import KVLedger, positions
from dflash_server.engine.runs import Run
from dflash_server.engine.streams import Streams
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.pair import ModelPair

log = logging.getLogger("dflash_server")


class Rounds:
    """The requests of one engine's loaded models: admitted from ``pending`` into ``active``
    (both the engine's, guarded by ``cond``), stepped and delivered a round at a time."""

    def __init__(
        self,
        pair: ModelPair,
        streams: Streams,
        *,
        cond: threading.Condition,
        pending: collections.deque[Job],
        active: list[Run],
        stopping: Callable[[], bool],
        max_active: int,
        ledger: KVLedger | None,
        batch: BatchDecoder | None,
        on_pass: Callable[[int, int], None] | None,
        heartbeat_s: float | None,
    ) -> None:
        """``stopping``: the engine is stopping (a round in progress ends early);
        ``heartbeat_s``: with ranks in lockstep, an idle round still runs this often."""
        self.pair, self.streams = pair, streams
        self._cond, self._pending, self._active = cond, pending, active
        self._stopping = stopping
        self.max_active, self.ledger, self.batch = max_active, ledger, batch
        self._on_pass, self._heartbeat_s = on_pass, heartbeat_s
        self._by_stream: dict[Hashable, Run] = {}
        self._token_texts: TokenTexts | None = None  # token names for logprobs, cached
        self.mean_job_s = 5.0  # running estimate for Retry-After

    def play(self, wait: bool = True) -> bool:
        """Admit waiting jobs up to ``max_active``, drop cancelled ones, then one step of the
        streams; each response (or error) goes to its request. ``wait``: block until there is
        work (a managed engine's worker waits for all its models instead). False once the
        engine is stopping."""
        with self._cond:
            while wait and not self._pending and not self._active and not self._stopping():
                if not self._cond.wait(self._heartbeat_s) and self._heartbeat_s is not None:
                    break  # idle: the round still runs, so the other ranks hear from this one
            if self._stopping():
                return False
            admitted = self._admit()
        for job in admitted:
            run = self._start(job)
            with self._cond:
                if run is not None:
                    self._active.append(run)
                elif self.ledger is not None:
                    self.ledger.release(job)
        for run in list(self._active):
            if self._stopping():
                return False
            if run.job.cancelled:
                log.info("request cancelled after %d tokens", run.produced)
                self._end(run, Failed("request cancelled"))
        if self.streams.busy:
            self._step()
        return True

    def end_all(self, message: str, status: int, code: str) -> None:
        """Every running request ends with a ``Failed`` event (shutdown, unload)."""
        for run in list(self._active):
            run.job.emit(Failed(message, status, code))
            self._close(run)

    def _admit(self) -> list[Job]:
        """The waiting jobs that start this round (under the condition)."""
        admitted: list[Job] = []
        while self._pending and len(self._active) + len(admitted) < self.max_active:
            head, busy = self._pending[0], bool(self._active or admitted)
            if self.ledger is not None and not self.ledger.admit(
                head, positions(head.request), busy
            ):
                break  # in order: the head waits for memory, and the ones behind it too
            admitted.append(self._pending.popleft())
        return admitted

    def _step(self) -> None:
        """One step of the streams; each outcome goes to its run."""
        passes = self.batch.passes if self.batch is not None else 0
        for stream, outcome in self.streams.step().items():
            run = self._by_stream[stream]
            if isinstance(outcome, Exception):
                log.error("generation failed", exc_info=outcome)
                self._end(run, Failed(f"generation failed: {outcome}"))
            elif run.deliver(outcome):
                self._end(run, run.finished())
        if self._on_pass is not None and self.batch is not None and self.batch.passes > passes:
            self._on_pass(*self.batch.last_pass)

    def _start(self, job: Job) -> Run | None:
        """Make the job's run: its stream starts (its prefill at this round's step)."""
        if job.cancelled:
            return None
        tokenizer = self.pair.tokenizer
        job.started = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):  # prompt text only ever at debug level
            log.debug("request prompt: %r", tokenizer.decode(job.request.prompt)[-2000:])
        if not self._active:
            mx.reset_peak_memory()  # the peak of the busy period that starts here
        texts = None
        if job.request.logprobs is not None:
            texts = self._token_texts or TokenTexts(tokenizer)
            self._token_texts = texts
        try:
            stream = self.streams.start(job.request)
        except Exception as exc:
            log.exception("generation failed")
            job.emit(Failed(f"generation failed: {exc}"))
            return None
        run = self._by_stream[stream] = Run(job, stream, texts)
        return run

    def _end(self, run: Run, final: Event) -> None:
        """Once a run has its final event: free its slot, then tell the client (its next
        request must fit)."""
        self._close(run)
        run.job.emit(final)

    def _close(self, run: Run) -> None:
        """Drop an ended run; its stream leaves (caches freed now, not at GC)."""
        with self._cond:
            if run in self._active:
                self._active.remove(run)
            if self.ledger is not None:
                self.ledger.release(run.job)
        try:
            if self._by_stream.pop(run.stream, None) is not None:
                self.streams.stop(run.stream)
        except Exception:
            log.exception("closing a generation failed")
        elapsed = time.monotonic() - (run.job.started or run.job.created)
        self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * elapsed
