"""Several models on one worker (docs/design.md, "Several models"; docs/operations.md, "Several
models"): the one place that loads, unloads and keeps within the memory budget.

One thread owns every MLX call. Each turn it runs one round of every loaded model with work
(a chat model's batched pass, an embedding model's piece), then unloads what outlived its
idle ``ttl`` or was asked to go, then loads one model that was asked for: first the least
recently used idle, unpinned models are unloaded until it fits the budget. Its load runs on
this thread too, and at every pause point (between two pieces of its weights, between two of
its cost measurements: ``generation/pauses.py``) the other models run one round, so a load
never holds their streams for longer than one piece. A model is loaded once at a time whatever
the requests that ask for it, and never unloaded while a request waits for it or runs on it
(its leases). With one model (``--target``) the engine keeps its own thread and this is a view.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import mlx.core as mx

from dflash_server.engine.jobs import EngineNotReady
from dflash_server.engine.model_slots import (
    EMBEDDINGS,
    LOADED,
    LOADING,
    UNLOADED,
    ModelSpec,
    Resident,
    Slot,
)
from dflash_server.engine.worker import SHUTDOWN, Engine
from dflash_server.generation.pauses import pausing

log = logging.getLogger("dflash_server")
ROOM_WAIT_S = 60.0  # a load waits this long for busy models to free the memory it needs


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
        self.budget, self.single = budget, single
        self._on_fatal, self._on_ready = on_fatal, on_ready
        self._cond = threading.Condition()
        self._stopping = self._draining = self._nested = False
        self._state = "loading"  # "ready" once the pinned models are loaded
        self._error: str | None = None
        self.current: Slot | None = None  # the slot being loaded
        self._thread = threading.Thread(target=self._thread_main, name="dflash-models", daemon=True)
        if single is not None:
            self.slots[0].resident = single

    @property
    def cond(self) -> threading.Condition:
        return self._cond

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
        return self.current is not None and self._thread.is_alive()

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
                    slot.resident._teardown()
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
        self._turn()
        self._unload_idle()
        self._load_next()
        return True

    def _has_work(self) -> bool:
        now = time.monotonic()
        for slot in self.slots:
            if slot.resident is not None and slot.state == LOADED and slot.resident.has_work:
                return True
            ready = slot.wanted and (slot.fetched or not slot.fetching)
            waits = slot.state == LOADING and self._waits_for_room(slot, now)  # said so once
            if slot.unload_asked or (ready and not waits):
                return True
            if self._expired(slot, now):
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

    def _expired(self, slot: Slot, now: float) -> bool:
        ttl = slot.spec.ttl
        return (
            slot.state == LOADED and not slot.spec.pinned and ttl is not None and not slot.busy
            and now - slot.last_used >= ttl
        )  # fmt: skip

    def _turn(self) -> None:
        """One round of each loaded model that has work."""
        for slot in self.slots:
            resident = slot.resident
            if resident is not None and slot.state == LOADED and resident.has_work:
                resident.round_once()

    def _between(self) -> None:
        """A load's pause point: the other models run one round (never a load inside a load),
        and their queued work ends before the load times its next piece."""
        if self._nested or self._stopping:
            return
        self._nested = True
        try:
            self._turn()
            mx.synchronize()
        finally:
            self._nested = False

    def _unload_idle(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            with self._cond:
                why = None
                if slot.unload_asked and slot.state == LOADED and not slot.busy:
                    why = "asked to (POST /v1/models/{id}/unload)"
                elif self._expired(slot, now):
                    why = f"idle for {now - slot.last_used:.0f} s (its ttl is {slot.spec.ttl:g} s)"
                slot.unload_asked = slot.unload_asked and slot.state == LOADED and why is None
                resident = self._take(slot) if why is not None else None
            if why is not None:
                self._free(slot, resident, why)

    def _take(self, slot: Slot) -> Resident | None:
        """Mark ``slot`` unloaded (under the lock, with the check that it is idle: a request
        that comes after it sees it unloaded and asks for it again)."""
        resident = slot.resident
        slot.resident, slot.state, slot.charge, slot.unload_asked = None, UNLOADED, 0, False
        return resident

    def _free(self, slot: Slot, resident: Resident | None, why: str) -> None:
        log.info("unloading model %r: %s", slot.id, why)
        if resident is not None:
            resident.unload()
        del resident
        gc.collect()
        mx.clear_cache()

    def _waits_for_room(self, slot: Slot, now: float) -> bool:
        """A wanted model that must wait for busy models to free memory (re-checked later)."""
        if not self.budget:
            return False
        return self._room_for(slot) is None and now - slot.wanted_since < ROOM_WAIT_S

    def _room_for(self, slot: Slot) -> list[Slot] | None:
        """The idle models to unload so that ``slot`` fits (least recently used first), or None
        while busy or pinned models leave no room."""
        if not self.budget:
            return []
        used = sum(s.expected for s in self.slots if s is not slot and s.state != UNLOADED)
        victims, free = [], self.budget - used
        idle = [s for s in self.slots if s.state == LOADED and not s.spec.pinned and not s.busy]
        for victim in sorted((s for s in idle if s is not slot), key=lambda s: s.last_used):
            if free >= slot.expected:
                break
            victims.append(victim)
            free += victim.expected
        return victims if free >= slot.expected else None

    def _load_next(self) -> None:
        with self._cond:
            wanted = sorted((s for s in self.slots if s.wanted), key=lambda s: s.wanted_since)
            slot = next((s for s in wanted if s.fetched or not s.fetching), None)
            if slot is None:
                return
            if not slot.fetched:
                slot.fetching, slot.state, slot.progress = True, LOADING, "downloading"
                threading.Thread(target=self._fetch, args=(slot,), daemon=True).start()
                return
            victims = self._room_for(slot)
            pinned = sum(s.expected for s in self.slots if s.spec.pinned and s is not slot)
            never = bool(self.budget) and slot.expected > self.budget - pinned  # not even alone
            if victims is None and not never and time.monotonic() - slot.wanted_since < ROOM_WAIT_S:
                slot.state, slot.progress = LOADING, "waiting for memory (busy models hold it)"
                return
            taken = [(v, self._take(v)) for v in victims or []]
        if victims is None:
            self._failed(slot, self._no_room(slot))
            return
        for victim, resident in taken:
            self._free(victim, resident, f"to make room for {slot.id!r} (--max-model-memory)")
        del taken
        self._load(slot)

    def _no_room(self, slot: Slot) -> str:
        held = ", ".join(f"{s.id!r}" for s in self.slots if s.state == LOADED and s is not slot)
        return (
            f"model {slot.id!r} needs about {slot.expected / 2**30:.2f} GiB but the models' "
            f"memory budget ({self.budget / 2**30:.2f} GiB) is held by busy or pinned models "
            f"({held or 'none'}): retry later, or raise --max-model-memory"
        )

    def _fetch(self, slot: Slot) -> None:
        try:
            assert slot.spec.fetch is not None
            estimate = slot.spec.fetch()
        except Exception as exc:
            self._failed(slot, str(exc))
        else:
            with self._cond:
                slot.fetched, slot.estimate = True, estimate or slot.estimate
        finally:
            with self._cond:
                slot.fetching = False
                self._cond.notify_all()

    def _failed(self, slot: Slot, message: str) -> None:
        log.error("cannot load model %r: %s", slot.id, message)
        with self._cond:
            slot.state, slot.error, slot.wanted, slot.progress = UNLOADED, message, None, None
            slot.finished_loads += 1
        if slot.spec.pinned and self._state == "loading":
            self._fatal(f"pinned model {slot.id!r} failed to load: {message}")

    def _load(self, slot: Slot) -> None:
        why = slot.wanted
        log.info("loading model %r (%s)", slot.id, why)
        with self._cond:
            slot.state, slot.progress, self.current = LOADING, "starting", slot
        try:
            resident = slot.spec.make(self._cond)
        except Exception as exc:
            self.current = None
            self._failed(slot, f"{type(exc).__name__}: {exc}")
            return
        start = time.perf_counter()

        def told(what: str) -> None:
            slot.progress = what

        with pausing(self._between, told):
            ok = resident.load()
        self.current = None
        if not ok:
            self._failed(slot, resident.error or "loading failed")
            resident.unload()
            return
        seconds = time.perf_counter() - start
        weights = resident.weight_bytes  # counted, not measured: other models ran meanwhile
        reserved = 0
        if isinstance(resident, Engine):
            reserved = (resident.ledger.budget if resident.ledger else 0) + (
                resident.prefix_cache.budget if resident.prefix_cache else 0
            )
        with self._cond:
            slot.resident, slot.state, slot.progress, slot.error = resident, LOADED, None, None
            slot.charge, slot.wanted = max(1, weights + reserved), None
            slot.loads, slot.load_seconds = slot.loads + 1, round(seconds, 3)
            slot.finished_loads += 1
            slot.last_used = time.monotonic()
        log.info(
            "model %r loaded in %.1f s (%.2f GiB of weights; %.2f GiB counted against the budget)",
            slot.id, seconds, weights / 2**30, slot.charge / 2**30,
        )  # fmt: skip
        if self._state == "loading" and not any(
            s.spec.pinned and s.state != LOADED for s in self.slots
        ):
            self._ready()

    def _ready(self) -> None:
        self._state = "ready"
        if self._on_ready is not None:
            self._on_ready()

    def _fatal(self, message: str) -> None:
        self._state, self._error = "error", message
        if self._on_fatal is not None:
            self._on_fatal(message)
