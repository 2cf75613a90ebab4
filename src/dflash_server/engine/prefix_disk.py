"""The prefix cache's optional disk tier: snapshots as safetensors files, across restarts.

Files (``prefix_file.py``: the snapshot's tensors, its metadata and their checksum) are written
from a background thread (the worker only queues them) and read back on a RAM miss; the index is
rebuilt at startup from the headers alone, and a file's checksum is verified when it is read
back. Damaged files, truncated ones and older files without a checksum are removed with a
warning (the request prefills cold); files of other models and foreign files are left alone
with a warning. The oldest files go when the folder outgrows its budget. Snapshots waiting to be
written are held in memory beyond the RAM tier's budget: at most ``max_pending`` bytes of them,
after which ``save`` waits for the writer (it never drops one, so every rank of a group keeps
the same files). A file is written under ``.partial/``, synced, then renamed into the folder, so
a killed process leaves no torn entry (the next start deletes what ``.partial/`` holds); a
folder that cannot be written (read-only, full) gets one warning and no more writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np

from dflash_server.engine.prefix_file import (
    FORMAT,
    Damaged,
    decode,
    digest,
    encode,
    kind_of,
    read_header,
    stored_tokens,
)
from dflash_server.generation.prefix import PromptSnapshot, common_prefix, restorable

log = logging.getLogger("dflash_server")
READ_THREADS = min(8, os.cpu_count() or 1)  # a request waits for the check: hash in parallel
PARTIAL = ".partial"  # the subfolder files are written in before their rename into the folder
STALLED_S = 60.0  # a full write queue that no write leaves in this long: the disk has stalled
_OURS = re.compile(r"[0-9a-f]{32}\.safetensors")  # the names _write gives


@dataclass
class _File:
    path: Path
    kind: tuple
    tokens: np.ndarray
    checkpoints: tuple[int, ...]
    recurrent: bool
    nbytes: int

    def restorable(self, limit: int) -> int:
        return restorable(limit, self.recurrent, self.checkpoints)


class PrefixDisk:
    """Snapshots in ``folder`` (up to ``budget`` bytes) for the models with ``fingerprint``."""

    def __init__(
        self, folder: str | Path, budget: int, fingerprint: str, max_pending: int = 1 << 30
    ) -> None:
        self.folder = Path(folder).expanduser()
        self.budget, self.fingerprint = budget, fingerprint
        self._files: dict[Path, _File] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[tuple, PromptSnapshot, int] | None] = queue.Queue()
        self.max_pending, self.pending = max_pending, 0  # bytes queued, not yet written
        self._written = threading.Condition()  # signalled as the writer frees pending bytes
        self.writes = self.reads = self.rejected = 0
        self.writable = True  # False after a write failed (read-only or full): RAM tier only
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._stop_writing(exc)
        self._remove_partial()
        if self.folder.is_dir():
            for path in sorted(self.folder.glob("*.safetensors"), key=_mtime):
                self._index(path)
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()

    def describe(self) -> str:
        state = "" if self.writable else ", not writable: read only"
        return (
            f"{self.folder} ({len(self._files)} entries, budget {self.budget / 2**30:.1f} GiB"
            f"{state})"
        )

    def _remove_partial(self) -> None:
        """Files a killed process left half-written (never indexed: they are renamed into the
        folder only once complete and synced) are deleted."""
        partial = self.folder / PARTIAL
        leftovers = sorted(partial.glob("*")) if partial.is_dir() else []
        for path in leftovers:
            try:
                path.unlink()
            except OSError as exc:
                log.warning("prefix cache: cannot remove the partial write %s (%s)", path, exc)
                return
        if leftovers:
            log.warning("prefix cache: removed %d partial write(s) in %s", len(leftovers), partial)

    def _stop_writing(self, exc: BaseException) -> None:
        """One warning, then no more writes: the RAM tier keeps serving, reads go on."""
        if self.writable:
            self.writable = False
            log.warning(
                "prefix cache: cannot write to %s (%s); the disk tier stops writing until the "
                "next start (serving continues from RAM; free space, lower "
                "--prefix-cache-disk-bytes or pick a writable --prefix-cache-dir)",
                self.folder,
                exc,
            )

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._files),
                "bytes": sum(f.nbytes for f in self._files.values()),
                "writes": self.writes,
                "reads": self.reads,
                "rejected": self.rejected,  # files that failed verification, removed
                "writable": int(self.writable),
                "pending_bytes": self.pending,  # queued for writing, held in memory
            }

    def _index(self, path: Path) -> None:
        ours = _OURS.fullmatch(path.name) is not None
        try:
            meta = read_header(path)
            if meta.get("format") != FORMAT:
                if str(meta.get("format", "")).startswith("dflash-prefix-"):
                    raise Damaged(f"{meta['format']}: written without a checksum")
                raise ValueError(f"not a {FORMAT} file")
            if meta.get("fingerprint") != self.fingerprint:  # still good for those models
                log.warning("prefix cache: %s belongs to other models; ignored", path.name)
                return
            tokens = stored_tokens(meta)
            entry = _File(
                path,
                kind_of(meta),
                tokens.astype(np.int64),
                tuple(json.loads(meta["checkpoints"])),
                meta["recurrent"] == "1",
                path.stat().st_size,
            )
        except Exception as exc:  # whatever is wrong with one file, the server still starts
            if ours or isinstance(exc, Damaged):
                self._discard(path, exc)
            else:
                log.warning("prefix cache: %s is unreadable (%s); ignored", path.name, exc)
            return
        with self._lock:
            self._files[path] = entry

    def _discard(self, path: Path, reason: object) -> None:
        """A file of ours that cannot be trusted: out of the index and off the disk."""
        log.warning("prefix cache: %s cannot be verified (%s); removed", path.name, reason)
        with self._lock:
            self._files.pop(path, None)
            self.rejected += 1
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:  # never used anyway: it is out of the index
            log.warning("prefix cache: cannot remove %s (%s)", path.name, exc)

    # ----- reading (worker thread) -----------------------------------------------------------

    def lookup(
        self, kind: tuple, tokens: np.ndarray, limit: int, better_than: int
    ) -> PromptSnapshot | None:
        """The snapshot restoring more than ``better_than`` tokens of ``tokens``, if on disk."""
        with self._lock:
            scored = [
                (f.restorable(min(common_prefix(f.tokens, tokens), limit)), f)
                for f in self._files.values()
                if f.kind == kind
            ]
        for n, entry in sorted(scored, key=lambda s: -s[0]):
            if n <= better_than:
                return None
            try:
                snapshot = self._load(entry)
            except Exception as exc:  # damaged: never used; the next one, or a cold prefill
                self._discard(entry.path, exc)
                continue
            self.reads += 1
            return snapshot
        return None

    def _load(self, entry: _File) -> PromptSnapshot:
        loaded = mx.load(str(entry.path), return_metadata=True)
        arrays, meta = cast("tuple[dict[str, mx.array], dict[str, str]]", loaded)
        mx.eval(arrays)  # read it all now: what is verified is what gets restored
        if digest(meta, arrays, READ_THREADS) != meta.get("checksum"):
            raise Damaged("checksum mismatch")
        snapshot = decode(arrays, meta)
        if kind_of(meta) != entry.kind or not np.array_equal(snapshot.tokens, entry.tokens):
            raise Damaged("changed since it was indexed")
        return snapshot

    # ----- writing (background thread) -------------------------------------------------------

    def save(self, kind: tuple, snapshot: PromptSnapshot, bounded: bool = True) -> None:
        """Queue a snapshot for writing (dropped when writing has stopped). With more than
        ``max_pending`` bytes queued it first waits for the writer (``bounded``: at shutdown
        the snapshots are held in RAM anyway), so memory cannot grow with a slow disk; a disk
        that finishes no write for ``STALLED_S`` stops the writes, as a failed one does."""
        nbytes = snapshot.nbytes
        with self._written:
            while (
                bounded
                and self.writable
                and self.pending
                and self.pending + nbytes > self.max_pending
            ):
                if not self._written.wait(STALLED_S):  # a hung disk must not hang the worker
                    self._stop_writing(TimeoutError(f"no write finished in {STALLED_S:g} s"))
            if not self.writable:
                return
            self.pending += nbytes
        self._queue.put((kind, snapshot, nbytes))

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes (bounded by ``timeout``)."""
        self._queue.put(None)
        self._writer.join(timeout)

    def flush(self) -> None:
        """Wait until every queued snapshot is written and indexed."""
        self._queue.join()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, snapshot, nbytes = item
            try:
                if self.writable:
                    self._write(kind, snapshot)
            except Exception:
                log.exception("prefix cache: writing a snapshot failed")
            finally:
                del item, snapshot  # its arrays are freed before a waiting save goes on
                with self._written:
                    self.pending -= nbytes
                    self._written.notify_all()
                self._queue.task_done()

    def _write(self, kind: tuple, snapshot: PromptSnapshot) -> None:
        arrays, meta = encode(snapshot, kind, self.fingerprint)
        name = f"{uuid.uuid4().hex}.safetensors"
        partial = self.folder / PARTIAL / name
        try:
            partial.parent.mkdir(exist_ok=True)
            mx.save_safetensors(str(partial), arrays, metadata=meta)
            _fsync(partial)  # on disk before it gets its name: a crash leaves no torn entry
            self._evict(incoming=partial.stat().st_size)  # room first: never over the budget
            path = partial.rename(self.folder / name)
            _fsync(self.folder)  # the rename itself
        except (OSError, RuntimeError) as exc:  # MLX reports a full disk as RuntimeError
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            self._stop_writing(exc)
            return
        self.writes += 1
        self._index(path)
        self._evict()

    def _evict(self, incoming: int = 0) -> None:
        """The oldest files go until the rest, and ``incoming`` bytes, fit the budget."""
        with self._lock:
            files = list(self._files.values())  # in the order written: oldest first
            total = sum(f.nbytes for f in files) + incoming
            while files and total > self.budget:
                oldest = files.pop(0)
                total -= oldest.nbytes
                self._files.pop(oldest.path, None)
                with contextlib.suppress(OSError):  # out of the index: never read again
                    oldest.path.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's) data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
