"""One configured model of several (``engine/models.py``): what it is (``ModelSpec``) and where
it stands (``Slot``: loaded, loading or unloaded; its requests, memory and load history)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_server.engine.embeddings import Embedder
from dflash_server.engine.worker import Engine

CHAT, EMBEDDINGS = "chat", "embeddings"
KINDS = (CHAT, EMBEDDINGS)
LOADED, LOADING, UNLOADED = "loaded", "loading", "unloaded"

Resident = Engine | Embedder


@dataclass(frozen=True)
class ModelSpec:
    """A configured model. ``make`` builds a fresh resident (an ``Engine`` for chat, an
    ``Embedder`` for embeddings) over the worker's condition, to be loaded on the worker;
    ``fetch`` downloads its files (no MLX: run on a thread of its own first) and returns the
    bytes it will take once loaded (weights, KV budget, prefix cache), which count until it is
    measured (``estimate`` before that);
    ``ttl``: seconds idle before it is unloaded (None: never by time); ``config``: what the
    API serves it with (its settings)."""

    id: str
    make: Callable[[Any], Resident]
    kind: str = CHAT
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    ttl: float | None = None
    estimate: int = 0
    fetch: Callable[[], int] | None = None
    config: Any = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)


class Slot:
    """A configured model's state; every field is read and written under the models' lock."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._state = UNLOADED
        self.progress: str | None = None  # what its load is doing now
        self.error: str | None = None  # why its last load failed
        self.resident: Resident | None = None
        self.leases = 0  # requests between their arrival and their answer's end
        self.last_used = time.monotonic()
        self.wanted: str | None = None  # why it should be loaded (None: it need not be)
        self.wanted_since = 0.0
        self.unload_asked = False
        self.fetched = spec.fetch is None
        self.fetching = False
        self.charge = 0  # bytes counted against the budget while loaded (measured)
        self.estimate = spec.estimate  # what it will take, until it is loaded
        self.finished_loads = 0  # load attempts that ended, either way
        self.loads = 0  # successful loads
        self.load_seconds: float | None = None  # the last successful load's time

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def state(self) -> str:
        """loaded, loading or unloaded (the one-model server's: its own engine's)."""
        engine = self.resident
        if isinstance(engine, Engine) and not engine.managed:
            return {"ready": LOADED, "loading": LOADING}.get(engine.state, UNLOADED)
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value

    @property
    def engine(self) -> Engine | None:
        """The chat engine, while loaded."""
        return self.resident if isinstance(self.resident, Engine) else None

    @property
    def embedder(self) -> Embedder | None:
        """The embedding model's runner, while loaded."""
        return self.resident if isinstance(self.resident, Embedder) else None

    @property
    def requests(self) -> int:
        """Requests waiting for it or running on it."""
        queued = 0
        if self.engine is not None:
            queued = self.engine.queue_depth
        elif self.embedder is not None:
            queued = self.embedder.queue_depth
        return max(self.leases, queued)

    @property
    def busy(self) -> bool:
        """It holds or awaits requests: it is never unloaded then."""
        return self.leases > 0 or (self.resident is not None and self.resident.has_work)

    @property
    def expected(self) -> int:
        """What it takes (or will take) of the budget."""
        return self.charge or self.estimate

    def describe(self) -> dict[str, Any]:
        """Its state as ``/health`` and ``/v1/models`` show it."""
        out: dict[str, Any] = {
            "id": self.id,
            "kind": self.spec.kind,
            "state": self.state,
            "aliases": list(self.spec.aliases),
            "pinned": self.spec.pinned,
            "ttl": self.spec.ttl,
            "requests": self.requests,
            "memory_bytes": self.expected,
            "loads": self.loads,
            "load_seconds": self.load_seconds,
        }
        if self.state == LOADING:
            out["progress"] = self.progress
        if self.error is not None:
            out["error"] = self.error
        return out
