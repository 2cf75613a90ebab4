"""The prefix cache's optional disk tier: snapshots as safetensors files, across restarts.

Files are written from a background thread (the worker only queues them) and read back on a RAM
miss. Each file's safetensors metadata holds the models' fingerprint, the snapshot kind, its token
ids and checkpoint positions, so the index is rebuilt at startup from the headers alone, plus a
checksum of all of that and of every tensor (name, dtype, shape, bytes), verified when the file is
read back: a damaged snapshot would silently change answers. Damaged files, truncated ones and
older files without a checksum are removed with a warning (the request prefills cold); files of
other models and foreign files are left alone with a warning. The oldest files go when the folder
outgrows its budget. Snapshots waiting to be written are held in memory beyond the RAM tier's
budget: at most ``max_pending`` bytes of them, after which ``save`` waits for the writer (never
drops one, so every rank of a group keeps the same files). A file is written under ``.partial/``, synced, then renamed into the folder,
so a killed process leaves no torn entry (the next start deletes what ``.partial/`` holds); a
folder that cannot be written (read-only, full) gets one warning and no more writes.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np

from dflash_server.generation.prefix import (
    Checkpoint,
    LayerKV,
    PromptSnapshot,
    QuantKV,
    common_prefix,
    layer_arrays,
    restorable,
)

log = logging.getLogger("dflash_server")
FORMAT = "dflash-prefix-2"  # -1: no checksum
CHECKSUM = "sha256"  # hardware-accelerated on x86 and Apple silicon: ~2 GB/s a core
READ_THREADS = min(8, os.cpu_count() or 1)  # a request waits for the check: hash in parallel
PARTIAL = ".partial"  # the subfolder files are written in before their rename into the folder
_OURS = re.compile(r"[0-9a-f]{32}\.safetensors")  # the names _write gives


class Damaged(ValueError):
    """A file of ours that cannot be trusted: it is removed."""


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


def _read_header(path: Path) -> dict[str, str]:
    """The metadata; raises if the header is broken or the tensors overrun the file."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 64 * 2**20:
            raise ValueError("header too large")
        header = json.loads(f.read(size))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + size + end != path.stat().st_size:
        raise ValueError(f"{path.stat().st_size} bytes, the header describes {8 + size + end}")
    return header.get("__metadata__") or {}


def _digest(meta: dict[str, str], arrays: dict[str, mx.array], threads: int = 1) -> str:
    """Checksum of the metadata (but the checksum itself) and of every tensor's name, dtype,
    shape and bytes; the tensors are hashed on ``threads`` threads (hashlib frees the GIL)."""

    def tensor(name: str) -> bytes:
        a = arrays[name]
        h = hashlib.new(CHECKSUM, json.dumps([name, str(a.dtype), a.shape]).encode())
        h.update(memoryview(a))  # type: ignore[arg-type]  # mx.array is a buffer (row-contiguous)
        return h.digest()

    names = sorted(arrays)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        digests = list(pool.map(tensor, names))
    h = hashlib.new(CHECKSUM)
    h.update(
        json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode()
    )
    for digest in digests:
        h.update(digest)
    return f"{CHECKSUM}:{h.hexdigest()}"


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
            meta = _read_header(path)
            if meta.get("format") != FORMAT:
                if str(meta.get("format", "")).startswith("dflash-prefix-"):
                    raise Damaged(f"{meta['format']}: written without a checksum")
                raise ValueError(f"not a {FORMAT} file")
            if meta.get("fingerprint") != self.fingerprint:  # still good for those models
                log.warning("prefix cache: %s belongs to other models; ignored", path.name)
                return
            tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype=np.int32)
            entry = _File(
                path,
                _kind(meta["kind"]),
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
        if _digest(meta, arrays, READ_THREADS) != meta.get("checksum"):
            raise Damaged("checksum mismatch")
        tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype=np.int32)
        stored_kind = _kind(meta["kind"])
        if stored_kind != entry.kind or not np.array_equal(tokens, entry.tokens):
            raise Damaged("changed since it was indexed")
        # Per target layer: "kv", "recurrent", or "kv:<bits>:<group size>" (quantized).
        layers = json.loads(meta["layers"])
        kv = [_stored_kv(arrays, i, kind) for i, kind in enumerate(layers)]
        n_draft = int(meta["draft_layers"])
        draft_kv = [_stored_pair(arrays, f"draft.{i}") for i in range(n_draft)] if n_draft else None
        checkpoints: dict[int, Checkpoint] = {}
        for p, (slots, windowed) in json.loads(meta["checkpoints_layout"]).items():
            recurrent = [
                [arrays.get(f"ckpt.{p}.{j}.{k}") for k in range(n)] for j, n in enumerate(slots)
            ]
            draft = [_pair(arrays, f"dckpt.{p}.{i}") for i in range(n_draft)] if windowed else None
            checkpoints[int(p)] = Checkpoint(recurrent, draft)
        if any(
            a.shape[-2] != len(tokens)
            for pair in kv
            if pair is not None
            for a in layer_arrays(pair)
        ):
            raise Damaged(f"attention KV of another length than its {len(tokens)} tokens")
        return PromptSnapshot(tuple(int(t) for t in tokens), kv, draft_kv, checkpoints)

    # ----- writing (background thread) -------------------------------------------------------

    def save(self, kind: tuple, snapshot: PromptSnapshot, bounded: bool = True) -> None:
        """Queue a snapshot for writing (dropped when writing has stopped). With more than
        ``max_pending`` bytes queued it first waits for the writer (``bounded``: at shutdown
        the snapshots are held in RAM anyway), so memory cannot grow with a slow disk."""
        nbytes = snapshot.nbytes
        with self._written:
            while (
                bounded
                and self.writable
                and self.pending
                and self.pending + nbytes > self.max_pending
            ):
                self._written.wait()
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
        arrays: dict[str, mx.array] = {}
        layers = []
        for i, pair in enumerate(snapshot.kv):
            if isinstance(pair, QuantKV):
                layers.append(f"kv:{pair.bits}:{pair.group_size}")
                for part, (keys, values) in enumerate(zip(pair.keys, pair.values)):
                    arrays[f"kv.{i}.keys.{part}"], arrays[f"kv.{i}.values.{part}"] = keys, values
            else:
                layers.append("recurrent" if pair is None else "kv")
                if pair is not None:
                    arrays[f"kv.{i}.keys"], arrays[f"kv.{i}.values"] = pair
        for i, pair in enumerate(snapshot.draft_kv or []):
            arrays[f"draft.{i}.keys"], arrays[f"draft.{i}.values"] = pair
        layout = {}  # position -> (slots per recurrent layer, whether drafter windows are kept)
        for p, checkpoint in snapshot.checkpoints.items():
            for j, slots in enumerate(checkpoint.recurrent):
                arrays |= {f"ckpt.{p}.{j}.{k}": a for k, a in enumerate(slots) if a is not None}
            for i, pair in enumerate(checkpoint.draft or []):
                if pair is not None:
                    arrays[f"dckpt.{p}.{i}.keys"], arrays[f"dckpt.{p}.{i}.values"] = pair
            layout[p] = ([len(s) for s in checkpoint.recurrent], checkpoint.draft is not None)
        arrays = {k: mx.contiguous(a) for k, a in arrays.items()}  # a copy only where sliced
        mx.eval(arrays)
        tokens = np.asarray(snapshot.tokens, dtype=np.int32)
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "kind": json.dumps(list(kind)),
            "tokens": base64.b64encode(tokens.tobytes()).decode(),
            "checkpoints": json.dumps(sorted(snapshot.checkpoints)),
            "checkpoints_layout": json.dumps(layout),
            "recurrent": "1" if snapshot.recurrent else "0",
            "layers": json.dumps(layers),
            "draft_layers": str(len(snapshot.draft_kv or [])),
        }
        meta["checksum"] = _digest(meta, arrays)
        name = f"{uuid.uuid4().hex}.safetensors"
        partial = self.folder / PARTIAL / name
        try:
            partial.parent.mkdir(exist_ok=True)
            mx.save_safetensors(str(partial), arrays, metadata=meta)
            _fsync(partial)  # on disk before it gets its name: a crash leaves no torn entry
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

    def _evict(self) -> None:
        with self._lock:
            files = list(self._files.values())  # in the order written: oldest first
            total = sum(f.nbytes for f in files)
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


def _as_tuple(value: object) -> object:
    """JSON lists back into the nested tuples a snapshot kind is made of."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _kind(text: str) -> tuple:
    """A snapshot kind as stored (JSON) back into its tuple."""
    kind = _as_tuple(json.loads(text))
    if not isinstance(kind, tuple):
        raise Damaged(f"snapshot kind {text[:40]!r} is not a list")
    return kind


def _stored_kv(arrays: dict[str, mx.array], i: int, kind: str) -> LayerKV | None:
    """Target layer ``i``'s stored attention KV (None: a recurrent layer)."""
    if kind == "recurrent":
        return None
    if kind == "kv":
        return _stored_pair(arrays, f"kv.{i}")
    _, bits, group_size = kind.split(":")
    keys = tuple(arrays[f"kv.{i}.keys.{part}"] for part in range(3))
    values = tuple(arrays[f"kv.{i}.values.{part}"] for part in range(3))
    return QuantKV(keys, values, int(bits), int(group_size))  # type: ignore[arg-type]


def _pair(arrays: dict[str, mx.array], prefix: str) -> tuple[mx.array, mx.array] | None:
    keys = arrays.get(f"{prefix}.keys")
    return None if keys is None else (keys, arrays[f"{prefix}.values"])


def _stored_pair(arrays: dict[str, mx.array], prefix: str) -> tuple[mx.array, mx.array]:
    pair = _pair(arrays, prefix)
    if pair is None:
        raise Damaged(f"{prefix} is missing")
    return pair
