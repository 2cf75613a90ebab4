"""Several models on one worker (docs/design.md, "Several models"; docs/operations.md, "Several
models"): the requests' side (which model, its leases, waiting for its load) and the worker.

One thread owns every MLX call. Each turn it runs one round of every loaded model with work
(a chat model's batched pass, an embedding model's piece), then ``model_residency.py`` unloads
what outlived its idle ``ttl`` or was asked to go, and loads one model that was asked for,
making room for it within the memory budget. Its load runs on this thread too, and at every
pause point (between two pieces of its weights, between two of its cost measurements:
``generation/pauses.py``) the other models run one round, so a load never holds their streams
for longer than one piece. A model is loaded once at a time whatever the requests that ask for
it, and never unloaded while a request waits for it or runs on it (its leases). With one model
(``--target``) the engine keeps its own thread and this is a view.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.engine.allocator import trim
from dflash_server.engine.jobs import EngineNotReady
from dflash_server.engine.model_residency import Residency
from dflash_server.engine.model_slots import (
    EMBEDDINGS,
    LOADED,
    LOADING,
    UNLOADED,
    ModelSpec,
    Slot,
)
from dflash_server.engine.worker import SHUTDOWN, Engine

log = logging.getLogger("dflash_server")


class ModelLoadFailed(Exception):
    """The model a request waits for could not be loaded; the message says why."""


class ModelSet:
    """The configured models, looked up by id or alias; ``budget``: bytes the loaded models may
    take together (0: no limit). ``single``: the one-model server's engine (its own thread)."""

    def __init__(
        self,
        specs: list[ModelSpec],
        *,
        budget: int = 0,
        single: Engine | None = None,
        on_fatal: Callable[[str], None] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.slots = [Slot(spec) for spec in specs]
        self._names = {name: slot for slot in self.slots for name in slot.spec.names}
        self.single = single
        self._on_fatal, self._on_ready = on_fatal, on_ready
        self._cond = threading.Condition()
        self._stopping = self._draining = self._nested = False
        self._state = "loading"  # "ready" once the pinned models are loaded
        self._error: str | None = None
        self.residency = Residency(
            self.slots, budget, self._cond, pause=self._between, on_loaded=self._loaded,
            on_failed=self._failed,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._thread_main, name="dflash-models", daemon=True)
        if single is not None:
            self.slots[0].resident = single

    @property
    def cond(self) -> threading.Condition:
        return self._cond

    @property
    def budget(self) -> int:
        """Bytes the loaded models may take together (0: no limit)."""
        return self.residency.budget

    @property
    def state(self) -> str:
        """The server's: "loading" until its pinned models (or its one model) are loaded,
        "ready", or "error" when one of those failed."""
        return self.single.state if self.single is not None else self._state

    @property
    def error(self) -> str | None:
        return self.single.error if self.single is not None else self._error

    @property
    def multi(self) -> bool:
        """Several models from a models file (not the one-model server)."""
        return self.single is None

    # ----- event-loop side -------------------------------------------------------------------
    def find(self, name: str | None) -> Slot | None:
        """The slot a request's ``model`` names (None: the first chat model)."""
        if name is None:
            return next((s for s in self.slots if s.spec.kind != EMBEDDINGS), self.slots[0])
        return self._names.get(name)

    def start(self) -> None:
        if self.single is not None:
            self.single.start()
        elif self._thread.ident is None:
            with self._cond:
                for slot in self.slots:
                    if slot.spec.pinned:
                        self._want(slot, "pinned: loaded at start")
            if not any(s.spec.pinned for s in self.slots):
                self._ready()  # the others load when asked for
            self._thread.start()

    def drain(self) -> None:
        if self.single is not None:
            self.single.drain()
        for slot in self.slots:
            if slot.engine is not None and slot.engine is not self.single:
                slot.engine.drain()
        self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        if self.single is not None:
            self.single.stop(timeout)
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for slot in self.slots:
            if isinstance(slot.resident, Engine):
                slot.resident.stop()
            elif slot.resident is not None:
                slot.resident.stop(SHUTDOWN)
        if self._thread.is_alive() and not self.loading:
            self._thread.join(timeout)

    @property
    def loading(self) -> bool:
        """The worker is inside a load (MLX: it cannot be interrupted)."""
        if self.single is not None:
            return self.single.loading
        return self.residency.current is not None and self._thread.is_alive()

    @property
    def stuck(self) -> bool:
        return self.single.stuck if self.single is not None else False

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return sum(slot.requests for slot in self.slots)

    def lease(self, slot: Slot, why: str = "a request asked for it") -> int:
        """A request's hold on ``slot``: it is loaded if need be and not unloaded until
        ``release``; returns the load attempts finished so far (for ``wait_loaded``)."""
        with self._cond:
            slot.leases += 1
            slot.last_used = time.monotonic()
            if self.single is None and slot.state != LOADED:
                self._want(slot, why)
            return slot.finished_loads

    def release(self, slot: Slot) -> None:
        with self._cond:
            slot.leases = max(0, slot.leases - 1)
            slot.last_used = time.monotonic()
            self._cond.notify_all()

    async def wait_loaded(
        self, slot: Slot, seen: int, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> None:
        """Until ``slot`` is loaded; raises ``ModelLoadFailed`` when a load attempt that ended
        after ``seen`` failed, ``EngineNotReady`` on shutdown, ``asyncio.CancelledError`` when
        the client left."""
        checked = time.monotonic()
        while True:
            with self._cond:
                if slot.state == LOADED:
                    return
                if slot.state == UNLOADED and slot.wanted is None and slot.finished_loads == seen:
                    self._want(slot, "a request asked for it")  # unloaded as it was asked for
                if slot.finished_loads > seen:
                    raise ModelLoadFailed(slot.error or f"model {slot.id!r} could not be loaded")
                if self._stopping or self._draining:
                    raise EngineNotReady(SHUTDOWN)
            await asyncio.sleep(0.02)
            if is_disconnected is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if await is_disconnected():
                    raise asyncio.CancelledError

    def ask_unload(self, slot: Slot) -> str | None:
        """Unload ``slot`` at the worker's next turn; why not, when it cannot go now."""
        with self._cond:
            if self.single is not None:
                return "this server serves one model (--target); it is never unloaded"
            if slot.spec.pinned:
                return f"model {slot.id!r} is pinned: it never unloads"
            if slot.busy:
                return f"model {slot.id!r} has {slot.requests} request(s) waiting or running"
            slot.wanted, slot.unload_asked = None, True
            self._cond.notify_all()
            return None

    async def wait_unloaded(self, slot: Slot) -> None:
        while True:
            with self._cond:
                if slot.state == UNLOADED or not slot.unload_asked:
                    return
            await asyncio.sleep(0.02)

    def memory(self) -> dict[str, int]:
        with self._cond:
            used = sum(s.expected for s in self.slots if s.state in (LOADED, LOADING))
            return {"budget_bytes": self.budget, "in_use_bytes": used}

    # ----- worker thread ---------------------------------------------------------------------
    def _want(self, slot: Slot, why: str) -> None:
        if slot.wanted is None and slot.state == UNLOADED:
            slot.wanted, slot.wanted_since = why, time.monotonic()
        slot.unload_asked = False
        self._cond.notify_all()

    def _thread_main(self) -> None:
        try:
            while self._next():
                pass
        finally:
            for slot in self.slots:  # every open stream gets a final event
                if isinstance(slot.resident, Engine):
                    slot.resident.teardown()
                elif slot.resident is not None:
                    slot.resident.stop(SHUTDOWN)
            mx.clear_streams()  # docs/development.md, "MLX on other threads"

    def _next(self) -> bool:
        """One turn: wait for work, run each loaded model's round, unload, load."""
        with self._cond:
            while not self._stopping and not self._has_work():
                self._cond.wait(self._timeout())
            if self._stopping:
                return False
        ran = self._turn()
        self.residency.unload_idle()
        self.residency.load_next()
        trim(idle=not ran)  # freed memory back to the system (allocator.py)
        return True

    def _has_work(self) -> bool:
        now, residency = time.monotonic(), self.residency
        for slot in self.slots:
            if slot.resident is not None and slot.state == LOADED and slot.resident.has_work:
                return True
            ready = slot.wanted and (slot.fetched or not slot.fetching)
            waits = slot.state == LOADING and residency.waits_for_room(slot, now)  # said so once
            if slot.unload_asked or (ready and not waits):
                return True
            if residency.expired(slot, now):
                return True
        return False

    def _timeout(self) -> float | None:
        now, waits = time.monotonic(), []
        for slot in self.slots:
            if slot.state == LOADED and slot.spec.ttl is not None and not slot.spec.pinned:
                waits.append(max(0.0, slot.last_used + slot.spec.ttl - now))
            if slot.wanted:
                waits.append(0.25)  # waiting for room: look again soon
        return min(waits) + 0.01 if waits else None

    def _turn(self) -> bool:
        """One round of each loaded model that has work; whether any had."""
        ran = False
        for slot in self.slots:
            resident = slot.resident
            if resident is not None and slot.state == LOADED and resident.has_work:
                resident.round_once()
                ran = True
        return ran

    def _between(self) -> bool:
        """A load's pause point: the other models run one round (never a load inside a load),
        and their queued work ends before the load times its next piece; whether any ran."""
        if self._nested or self._stopping:
            return False
        self._nested = True
        try:
            ran = self._turn()
            mx.synchronize(generation_stream)  # where their passes run (not the default)
            return ran
        finally:
            self._nested = False

    def _loaded(self) -> None:
        """After a load: the server is ready once its pinned models are loaded."""
        if self._state == "loading" and not any(
            s.spec.pinned and s.state != LOADED for s in self.slots
        ):
            self._ready()

    def _failed(self, slot: Slot, message: str) -> None:
        if slot.spec.pinned and self._state == "loading":
            self._fatal(f"pinned model {slot.id!r} failed to load: {message}")

    def _ready(self) -> None:
        self._state = "ready"
        if self._on_ready is not None:
            self._on_ready()

    def _fatal(self, message: str) -> None:
        self._state, self._error = "error", message
        if self._on_fatal is not None:
            self._on_fatal(message)
