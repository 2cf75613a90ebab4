"""What the engine hands between the event loop and its worker: jobs and their events."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_server.chat.logprobs import TokenLogprob
from dflash_server.generation.request import GenerationRequest
from dflash_server.generation.stats import SpeculativeStats


class QueueFull(Exception):
    """The wait queue is at capacity; ``retry_after`` is a guess in seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("queue full")
        self.retry_after = retry_after


class EngineNotReady(Exception):
    """Models are still loading, or loading failed."""


@dataclass
class TextChunk:
    """New output text and how many tokens produced it."""

    text: str
    tokens: int
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them
    sources: list[tuple[str, bool]] | None = None  # per token: (text, accepted draft?)


@dataclass(frozen=True)
class RequestTimings:
    """How a finished request went, as the ``dflash`` object and /metrics report it."""

    queue_wait_s: float  # from submission to admission
    prompt_tps: float  # prefilled (not restored) prompt tokens per second
    generation_tps: float
    peak_memory_gb: float


@dataclass
class Finished:
    """The last event of a successful job."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculative: bool = False  # whether the drafter ran
    block_size: int = 1  # the widest block the request could verify
    stats: SpeculativeStats | None = None  # the decoder's counters (None: nothing generated)
    timings: RequestTimings | None = None
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled
    stop_sequence: str | None = None  # the stop string that ended it, if one did


@dataclass
class Failed:
    """The last event of a job that raised or was stopped; ``message`` is safe to show the client.

    ``status``/``code`` are what a non-streamed response answers with (503 on shutdown).
    """

    message: str
    status: int = 500
    code: str = "generation_failed"


Event = TextChunk | Finished | Failed


class Job:
    """One generation request: created on the event loop, run on the worker thread."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
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
        self._on_cancel: Callable[[], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the job is cancelled (the engine drops it from its queue)."""
        self._on_cancel = callback

    def cancel(self) -> None:
        """Stop the job: drop it from the queue, or stop generating at the next cycle."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            if self._on_cancel is not None:
                self._on_cancel()

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
                sources = None if ev.sources is None else (last.sources or []) + ev.sources
                merged[-1] = TextChunk(last.text + ev.text, last.tokens + ev.tokens, lps, sources)
            else:
                merged.append(ev)
            if isinstance(ev, Finished | Failed):
                self._done = True
        return merged
