"""The several-models worker's rules (engine/models.py) with stand-in models: one load per
model, least-recently-used eviction within the memory budget, pinned models kept, busy models
never unloaded, idle TTLs, a failed load answered while the others keep serving, and other
models' rounds running at every pause point of a load."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, ClassVar

import pytest

from dflash_server.engine.model_slots import LOADED, UNLOADED, ModelSpec
from dflash_server.engine.models import ModelLoadFailed, ModelSet
from dflash_server.generation.pauses import pause

MB = 2**20


class Stand:
    """A resident model: ``load`` runs ``pieces`` pauses (recording what other models did
    meanwhile), then takes ``size`` bytes of the budget (its spec's estimate)."""

    log: ClassVar[list[str]] = []

    def __init__(
        self, name: str, pieces: int = 3, fail: bool = False, load_s: float = 0.0, size: int = MB
    ):
        self.name, self.pieces, self.fail, self.load_s = name, pieces, fail, load_s
        self.weight_bytes = size
        self.work = 0  # rounds of work queued (a running stream)
        self.rounds = 0
        self.state, self.error = "loading", None
        self.unloaded = False

    def load(self) -> bool:
        Stand.log.append(f"load {self.name}")
        for _ in range(self.pieces):
            time.sleep(self.load_s / max(1, self.pieces))
            pause()
        if self.fail:
            self.error, self.state = f"{self.name} is broken", "error"
            return False
        self.state = "ready"
        return True

    @property
    def has_work(self) -> bool:
        return self.work > 0

    def round_once(self) -> None:
        self.work -= 1
        self.rounds += 1
        Stand.log.append(f"round {self.name}")

    def unload(self) -> None:
        self.unloaded = True
        Stand.log.append(f"unload {self.name}")

    def stop(self, *_: Any) -> None:
        pass


def _set(*specs: tuple[str, dict[str, Any]], budget: int = 0) -> tuple[ModelSet, dict[str, Any]]:
    made: dict[str, list[Stand]] = {}

    def spec(name: str, pinned: bool = False, ttl: float | None = None, size: int = MB, **kw: Any):
        def make(_: Any) -> Any:
            stand = Stand(name, size=size, **kw)
            made.setdefault(name, []).append(stand)
            return stand

        return ModelSpec(name, make, pinned=pinned, ttl=ttl, estimate=size)

    models = ModelSet([spec(name, **kw) for name, kw in specs], budget=budget)
    return models, made


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _loaded(models: ModelSet, name: str) -> None:
    slot = models.find(name)
    assert slot is not None
    seen = models.lease(slot)
    asyncio.run(models.wait_loaded(slot, seen))
    models.release(slot)


@pytest.fixture(autouse=True)
def _fresh_log() -> None:
    Stand.log = []


def test_one_load_per_model_under_concurrent_requests() -> None:
    models, made = _set(("a", {"load_s": 0.2}))
    models.start()
    slot = models.find("a")
    assert slot is not None
    seen = [models.lease(slot) for _ in range(8)]  # eight first requests at once

    async def all_wait() -> None:
        await asyncio.gather(*(models.wait_loaded(slot, s) for s in seen))

    asyncio.run(all_wait())
    assert len(made["a"]) == 1 and Stand.log.count("load a") == 1
    assert slot.state == LOADED and slot.loads == 1
    models.stop()


def test_least_recently_used_idle_model_makes_room_and_pinned_stays() -> None:
    models, made = _set(
        ("p", {"pinned": True, "size": MB}), ("a", {"size": 4 * MB}), ("b", {"size": 4 * MB}),
        ("c", {"size": 4 * MB}), budget=9 * MB + MB // 2,
    )  # fmt: skip
    models.start()
    _wait(lambda: models.state == "ready")
    _loaded(models, "a")
    _loaded(models, "b")  # p + a + b = 9 MB: all fit
    _loaded(models, "a")  # a used after b: b is now the least recently used
    _loaded(models, "c")
    states = {s.id: s.state for s in models.slots}
    assert states == {"p": LOADED, "a": LOADED, "b": UNLOADED, "c": LOADED}
    assert made["b"][0].unloaded and not made["p"][0].unloaded
    models.stop()


def test_a_busy_model_is_never_unloaded_the_load_waits_for_it() -> None:
    models, made = _set(("a", {"size": 6 * MB}), ("b", {"size": 6 * MB}), budget=8 * MB)
    models.start()
    _loaded(models, "a")
    a = models.find("a")
    b = models.find("b")
    assert a is not None and b is not None
    held = models.lease(a)  # a request runs on a
    seen = models.lease(b)
    time.sleep(0.3)
    assert a.state == LOADED and b.state != LOADED and "waiting for memory" in str(b.progress)
    models.release(a)  # a's request ends: now b may take its room
    asyncio.run(models.wait_loaded(b, seen))
    assert a.state == UNLOADED and made["a"][0].unloaded and held == 1
    models.release(b)
    models.stop()


def test_idle_ttl_unloads_and_pinned_never_expires() -> None:
    models, _ = _set(("p", {"pinned": True, "ttl": 0.1}), ("a", {"ttl": 0.2}))
    models.start()
    _loaded(models, "a")
    a, p = models.find("a"), models.find("p")
    assert a is not None and p is not None
    _wait(lambda: a.state == UNLOADED)
    time.sleep(0.2)
    assert p.state == LOADED and "unload a" in Stand.log and "unload p" not in Stand.log
    models.stop()


def test_a_failed_load_answers_its_requests_and_the_others_keep_serving() -> None:
    models, _ = _set(("ok", {}), ("bad", {"fail": True}))
    models.start()
    _loaded(models, "ok")
    bad = models.find("bad")
    assert bad is not None
    seen = models.lease(bad)
    with pytest.raises(ModelLoadFailed, match="bad is broken"):
        asyncio.run(models.wait_loaded(bad, seen))
    models.release(bad)
    assert bad.state == UNLOADED and bad.error == "bad is broken"
    _loaded(models, "ok")  # still served
    seen = models.lease(bad)  # a later request tries again (and fails again, once)
    with pytest.raises(ModelLoadFailed):
        asyncio.run(models.wait_loaded(bad, seen))
    assert Stand.log.count("load bad") == 2
    models.stop()


def test_other_models_run_a_round_at_every_pause_point_of_a_load() -> None:
    models, made = _set(("a", {"pieces": 1}), ("b", {"pieces": 6}))
    models.start()
    _loaded(models, "a")
    made["a"][0].work = 100  # a stream running on a
    with models.cond:
        models.cond.notify_all()
    _loaded(models, "b")
    log = Stand.log[Stand.log.index("load b") :]
    # Between the start of b's load and its end, a's rounds ran at each of its 6 pauses.
    assert log[1:7] == ["round a"] * 6
    models.stop()


def test_explicit_unload_refused_while_busy_or_pinned() -> None:
    models, _ = _set(("p", {"pinned": True}), ("a", {}))
    models.start()
    _loaded(models, "a")
    a, p = models.find("a"), models.find("p")
    assert a is not None and p is not None
    models.lease(a)
    assert "request(s) waiting or running" in str(models.ask_unload(a))
    models.release(a)
    assert models.ask_unload(a) is None
    asyncio.run(models.wait_unloaded(a))
    assert a.state == UNLOADED
    _wait(lambda: p.state == LOADED)
    assert "pinned" in str(models.ask_unload(p))
    models.stop()


def test_threads_end_with_stop() -> None:
    before = threading.active_count()
    models, _ = _set(("a", {}))
    models.start()
    _loaded(models, "a")
    models.stop()
    _wait(lambda: threading.active_count() <= before)
