"""The prefix cache: prompt snapshots of earlier requests, reused by later ones.

See docs/design.md, "Prefix cache internals".

Agents and chat clients resend the whole conversation every turn; the next turn shares the
previous prompt up to the start of its generation prompt (templates re-render earlier answers,
so "prompt + answer" is rarely shared). Each entry is one prefilled prompt: attention KV for all
of it and recurrent state at its message boundaries. Lookup takes the entry restoring the longest
prefix; entries are evicted least recently used first, by bytes, and a checkpoint that a newer,
longer entry also holds is dropped from the older one. An optional disk tier keeps evicted
entries across restarts (``PrefixDisk``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dflash_server.generation.prefix import PromptSnapshot, common_prefix

if TYPE_CHECKING:
    from dflash_server.engine.prefix_disk import PrefixDisk

log = logging.getLogger("dflash_server")


@dataclass
class _Entry:
    kind: tuple
    snapshot: PromptSnapshot
    tokens: np.ndarray
    nbytes: int
    on_disk: bool = False


class PrefixCache:
    """LRU of prompt snapshots within ``budget`` bytes; used from the engine's worker thread
    (``stats`` may be read from any thread)."""

    def __init__(self, budget: int, disk: PrefixDisk | None = None) -> None:
        self.budget = budget
        self.disk = disk
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def add_disk(self, disk: PrefixDisk) -> None:
        """Add the disk tier. Its files carry the loaded models' fingerprint, known only once the
        worker has loaded them: the loader adds it then, before the first request."""
        if self.disk is not None:
            raise ValueError("the prefix cache has a disk tier already")
        self.disk = disk

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def describe(self) -> str:
        disk = "" if self.disk is None else f", disk tier {self.disk.describe()}"
        return f"{self.budget / 2**30:.1f} GiB RAM{disk}"

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {
                "entries": len(self._entries),
                "bytes": self.nbytes,
                "budget_bytes": self.budget,
                "hits": self.hits,
                "misses": self.misses,
            }
        if self.disk is not None:
            out |= {f"disk_{k}": v for k, v in self.disk.stats().items()}
        return out

    def lookup(self, kind: tuple, prompt: Sequence[int]) -> tuple[PromptSnapshot, int] | None:
        """The entry restoring the longest prefix of ``prompt`` (never all of it: the last
        token must be fed to get its logits), and that prefix's length."""
        tokens = np.asarray(prompt, dtype=np.int64)
        best = self._best(kind, tokens)
        if self.disk is not None:  # a longer prefix on disk comes back into RAM
            found = self.disk.lookup(kind, tokens, len(tokens) - 1, best[0] if best else 0)
            if found is not None:
                self.store(kind, found, on_disk=True)
                best = self._best(kind, tokens)
        with self._lock:
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(best[1])
            return self._entries[best[1]].snapshot, best[0]

    def _best(self, kind: tuple, tokens: np.ndarray) -> tuple[int, int] | None:
        """(restorable length, entry id) of the best entry for ``tokens``, if any."""
        best = None
        with self._lock:
            for key, entry in self._entries.items():
                if entry.kind != kind:
                    continue
                shared = common_prefix(entry.tokens, tokens)
                n = entry.snapshot.restorable(min(shared, len(tokens) - 1))
                if n > 0 and (best is None or n > best[0]):
                    best = (n, key)
        return best

    def store(self, kind: tuple, snapshot: PromptSnapshot, on_disk: bool = False) -> None:
        """Keep a prefilled prompt; drop what it makes redundant; evict to the budget."""
        tokens = np.asarray(snapshot.tokens, dtype=np.int64)
        nbytes = snapshot.nbytes
        if nbytes > self.budget:  # never fits in RAM: straight to the disk tier, if any
            self._spill(_Entry(kind, snapshot, tokens, nbytes, on_disk))
            return
        with self._lock:
            for key, old in list(self._entries.items()):
                if old.kind == kind and self._covered(old, tokens, snapshot):
                    del self._entries[key]
            self._entries[self._next_id] = _Entry(kind, snapshot, tokens, nbytes, on_disk)
            self._next_id += 1
            evicted = []
            while self.nbytes > self.budget:
                _, entry = self._entries.popitem(last=False)
                evicted.append(entry)
        for entry in evicted:
            self._spill(entry)

    def _spill(self, entry: _Entry, bounded: bool = True) -> None:
        if self.disk is not None and not entry.on_disk:
            entry.on_disk = True
            self.disk.save(entry.kind, entry.snapshot, bounded)

    def close(self) -> None:
        """On shutdown: what is only in RAM goes to the disk tier (if any), writes finish."""
        if self.disk is None:
            return
        with self._lock:
            entries = list(self._entries.values())
        for entry in entries:
            self._spill(entry, bounded=False)  # held in RAM already: no need to wait
        self.disk.close()

    @staticmethod
    def _covered(old: _Entry, tokens: np.ndarray, new: PromptSnapshot) -> bool:
        """Drop from ``old`` the checkpoints ``new`` holds too; True when nothing is left."""
        shared = common_prefix(old.tokens, tokens)
        if not old.snapshot.recurrent:  # KV only: the longer entry restores all of it
            return shared == len(old.tokens)
        kept = {
            p: c
            for p, c in old.snapshot.checkpoints.items()
            if not (p <= shared and p in new.checkpoints)
        }
        # A new snapshot, never the old one changed: a request may be restoring from it.
        old.snapshot = dataclasses.replace(old.snapshot, checkpoints=kept)
        old.nbytes = old.snapshot.nbytes
        return not kept
