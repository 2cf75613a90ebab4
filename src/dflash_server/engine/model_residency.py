"""Which of several models are resident (docs/design.md, "Several models"): decided on the
models' worker (``engine/models.py``) after each turn's rounds.

It unloads what outlived its idle ``ttl`` or an operator let go, then loads one model that was
asked for (the longest waiting whose files are there; a download runs on a thread of its own
first), after unloading the least recently used idle, unpinned models whose room it needs
within the memory budget. A busy or pinned model is never unloaded: a load that needs its room
waits for it, up to ``ROOM_WAIT_S``, then fails naming the fix. The load itself runs on the
worker, pausing for the other models' rounds (``pause`` is the worker's hook).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

import mlx.core as mx

from dflash_server.engine.kv_budget import gib
from dflash_server.engine.model_slots import LOADED, LOADING, UNLOADED, Resident, Slot
from dflash_server.engine.worker import Engine
from dflash_server.generation.pauses import pausing

log = logging.getLogger("dflash_server")
ROOM_WAIT_S = 60.0  # a load waits this long for busy models to free the memory it needs


class Residency:
    """The loads and unloads of ``slots`` within ``budget`` bytes (0: no limit), under the
    models' lock ``cond``. ``pause``: the worker's pause hook (the other models' rounds);
    ``on_loaded``: after each successful load; ``on_failed(slot, message)``: after a failed one."""

    def __init__(
        self,
        slots: list[Slot],
        budget: int,
        cond: threading.Condition,
        *,
        pause: Callable[[], bool],
        on_loaded: Callable[[], None],
        on_failed: Callable[[Slot, str], None],
    ) -> None:
        self.slots, self.budget, self._cond = slots, budget, cond
        self._pause, self._on_loaded, self._on_failed = pause, on_loaded, on_failed
        self.current: Slot | None = None  # the slot being loaded

    def expired(self, slot: Slot, now: float) -> bool:
        """Loaded, idle, unpinned and unused for its ``ttl``."""
        ttl = slot.spec.ttl
        return (
            slot.state == LOADED and not slot.spec.pinned and ttl is not None and not slot.busy
            and now - slot.last_used >= ttl
        )  # fmt: skip

    def waits_for_room(self, slot: Slot, now: float) -> bool:
        """A wanted model that must wait for busy models to free memory (re-checked later)."""
        if not self.budget:
            return False
        return self.room_for(slot) is None and now - slot.wanted_since < ROOM_WAIT_S

    def room_for(self, slot: Slot) -> list[Slot] | None:
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

    # ----- unloads ---------------------------------------------------------------------------
    def unload_idle(self) -> None:
        """Unload what an operator let go or what outlived its ``ttl``."""
        now = time.monotonic()
        for slot in self.slots:
            with self._cond:
                why = None
                if slot.unload_asked and slot.state == LOADED and not slot.busy:
                    why = "asked to (POST /v1/models/{id}/unload)"
                elif self.expired(slot, now):
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

    # ----- loads -----------------------------------------------------------------------------
    def load_next(self) -> None:
        """Load the longest-waiting wanted model, making room for it first (or start its
        download, or say it waits for memory)."""
        with self._cond:
            wanted = sorted((s for s in self.slots if s.wanted), key=lambda s: s.wanted_since)
            slot = next((s for s in wanted if s.fetched or not s.fetching), None)
            if slot is None:
                return
            if not slot.fetched:
                slot.fetching, slot.state, slot.progress = True, LOADING, "downloading"
                threading.Thread(target=self._fetch, args=(slot,), daemon=True).start()
                return
            victims = self.room_for(slot)
            pinned = sum(s.expected for s in self.slots if s.spec.pinned and s is not slot)
            never = bool(self.budget) and slot.expected > self.budget - pinned  # not even alone
            if victims is None and not never and time.monotonic() - slot.wanted_since < ROOM_WAIT_S:
                slot.state, slot.progress = LOADING, "waiting for memory (busy models hold it)"
                return
            taken = [(v, self._take(v)) for v in victims or []]
        if victims is None:
            self.failed(slot, self._no_room(slot))
            return
        for victim, resident in taken:
            self._free(victim, resident, f"to make room for {slot.id!r} (--max-model-memory)")
        del taken
        self._load(slot)

    def _no_room(self, slot: Slot) -> str:
        held = ", ".join(f"{s.id!r}" for s in self.slots if s.state == LOADED and s is not slot)
        return (
            f"model {slot.id!r} needs about {gib(slot.expected)} but the models' "
            f"memory budget ({gib(self.budget)}) is held by busy or pinned models "
            f"({held or 'none'}): retry later, or raise --max-model-memory"
        )

    def _fetch(self, slot: Slot) -> None:
        try:
            assert slot.spec.fetch is not None
            estimate = slot.spec.fetch()
        except Exception as exc:
            self.failed(slot, str(exc))
        else:
            with self._cond:
                slot.fetched, slot.estimate = True, estimate or slot.estimate
        finally:
            with self._cond:
                slot.fetching = False
                self._cond.notify_all()

    def failed(self, slot: Slot, message: str) -> None:
        """A load attempt ended without the model: its waiting requests hear ``message``."""
        log.error("cannot load model %r: %s", slot.id, message)
        with self._cond:
            slot.state, slot.error, slot.wanted, slot.progress = UNLOADED, message, None, None
            slot.finished_loads += 1
        self._on_failed(slot, message)

    def _load(self, slot: Slot) -> None:
        why = slot.wanted
        log.info("loading model %r (%s)", slot.id, why)
        with self._cond:
            slot.state, slot.progress, self.current = LOADING, "starting", slot
        try:
            resident = slot.spec.make(self._cond)
        except Exception as exc:
            self.current = None
            self.failed(slot, f"{type(exc).__name__}: {exc}")
            return
        start = time.perf_counter()

        def told(what: str) -> None:
            slot.progress = what

        with pausing(self._pause, told):
            ok = resident.load()
        self.current = None
        if not ok:
            self.failed(slot, resident.error or "loading failed")
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
            "model %r loaded in %.1f s (%s of weights; %s counted against the budget)",
            slot.id, seconds, gib(weights), gib(slot.charge),
        )  # fmt: skip
        self._on_loaded()
