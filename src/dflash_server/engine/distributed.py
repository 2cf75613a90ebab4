"""The ranks of one server spread over several machines: how they talk outside the model.

Under ``mlx.launch`` the target is tensor-sharded over an MLX distributed group (mlx-lm's
``Model.shard``) and every rank runs the same engine rounds (``engine/lockstep.py``). This module
is their plumbing (docs/design.md, "Several machines"):

* ``Channel``: one fixed-size frame per round through ``all_sum``: rank 0's message (its
  decisions), each rank's memory back to rank 0; a longer message takes a second collective;
* ``check_same``: at start every rank compares its files, settings and versions with rank 0's
  and refuses to run, naming the first difference;
* ``Watchdog``: a round that takes longer than ``--rank-timeout`` means a rank hung;
* ``RankLost`` and ``lost``: which errors mean that another rank died, hung or diverged.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from dflash_server.engine.calibration import CalibrationCache, T, measured

log = logging.getLogger("dflash_server")

SLOT = 16  # per rank in each frame: active and peak memory (two little-endian uint64)
INLINE = 2048  # message bytes a frame carries itself; longer ones take a second all_sum
# What MLX's backends put in front of their errors (a peer that closed its socket, ...).
_TRANSPORT = re.compile(r"^\[(ring|jaccl|mpi|nccl)\]")


class RankLost(RuntimeError):
    """Another rank died, hung or diverged: this process stops (rank 0 answers 503 first)."""


class Mismatch(RuntimeError):
    """The ranks loaded different files or settings; the message names the first difference."""


def world() -> Any | None:
    """The MLX distributed group this process was launched in (``mlx.launch``), or None when it
    runs alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def lost(exc: BaseException) -> bool:
    """Whether an error came from the transport between ranks (a peer is gone), not from a
    request's own decoding."""
    return isinstance(exc, RankLost) or bool(_TRANSPORT.match(str(exc)))


def _summed(group: Any, data: np.ndarray) -> np.ndarray:
    """``all_sum`` of a host array; a transport error is a lost rank. On mlx-lm's generation
    stream, where the model's own collectives run: one stream executes in the order work was
    queued, so every rank pairs its collectives with the others' in the same order."""
    try:
        out = mx.distributed.all_sum(mx.array(data), group=group, stream=generation_stream)
        mx.eval(out)
    except RuntimeError as exc:
        if lost(exc):
            raise RankLost(f"lost another rank ({exc}): restart every rank") from exc
        raise
    return np.array(out)


def everyone(group: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a collective: every rank must ask)."""
    return int(_summed(group, np.array([int(flag)], np.int32))[0]) == group.size()


class Channel:
    """Rank 0's message of each round to every rank, and every rank's memory back to rank 0.

    One frame per round: ``size`` slots of memory figures, the message length, then up to
    ``INLINE`` message bytes; each rank writes only its own bytes and the others leave zeros,
    so the sum is everybody's bytes at once. ``memory`` holds (active, peak) bytes per rank as
    of the last round. Every rank calls ``exchange`` the same number of times.
    """

    def __init__(self, group: Any) -> None:
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.memory: list[tuple[int, int]] = [(0, 0)] * self.size
        self.rounds = 0
        self.bytes = 0  # message bytes sent so far (rank 0)

    def exchange(self, message: bytes = b"") -> bytes:
        """Send ``message`` (rank 0) or receive it (every other rank); returns it everywhere."""
        head = self.size * SLOT
        frame = np.zeros(head + 8 + INLINE, np.uint8)
        mine = np.array([mx.get_active_memory(), mx.get_peak_memory()], "<u8").view(np.uint8)
        frame[self.rank * SLOT : (self.rank + 1) * SLOT] = mine
        if self.rank == 0:
            frame[head : head + 8] = np.array([len(message)], "<u8").view(np.uint8)
            inline = np.frombuffer(message[:INLINE], np.uint8)
            frame[head + 8 : head + 8 + inline.size] = inline
        summed = _summed(self.group, frame)
        figures = summed[:head].copy().view("<u8").reshape(self.size, 2)
        self.memory = [(int(a), int(p)) for a, p in figures]
        length = int(summed[head : head + 8].copy().view("<u8")[0])
        body = summed[head + 8 : head + 8 + min(length, INLINE)].tobytes()
        if length > INLINE:  # an admitted long prompt: the rest in one more collective
            rest = np.zeros(length - INLINE, np.uint8)
            if self.rank == 0:
                rest[:] = np.frombuffer(message[INLINE:], np.uint8)
            body += _summed(self.group, rest).tobytes()
        self.rounds += 1
        self.bytes += length
        return body


def gather(group: Any, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (two collectives)."""
    sizes = np.zeros(group.size(), np.int32)
    sizes[group.rank()] = len(data)
    sizes = _summed(group, sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    buffer = np.zeros(int(starts[-1]), np.uint8)
    buffer[starts[group.rank()] : starts[group.rank() + 1]] = np.frombuffer(data, np.uint8)
    summed = _summed(group, buffer)
    return [summed[a:b].tobytes() for a, b in itertools.pairwise(starts)]


def check_same(group: Any, items: dict[str, str]) -> None:
    """Compare ``items`` (name -> value: files, settings, versions) with rank 0's on every rank;
    raise ``Mismatch`` naming the first difference (every rank raises the same)."""
    ranks = [json.loads(b) for b in gather(group, json.dumps(items, sort_keys=True).encode())]
    reference = ranks[0]
    for rank, theirs in enumerate(ranks[1:], start=1):
        for name in sorted(set(reference) | set(theirs)):
            if theirs.get(name) != reference.get(name):
                raise Mismatch(
                    f"rank {rank} differs from rank 0 in {name}: {theirs.get(name, 'absent')} "
                    f"there, {reference.get(name, 'absent')} on rank 0; give every rank the "
                    "same files and settings"
                )


def file_digests(label: str, folder: Path) -> dict[str, str]:
    """What identifies a model folder's files on any machine (not their paths or times): each
    config file's contents and each weight file's size, header and first and last MiB."""
    out = {}
    for f in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        size = f.stat().st_size
        with f.open("rb") as fh:
            if f.suffix == ".json":
                h.update(fh.read())
            else:
                h.update(fh.read(2**20))
                fh.seek(max(0, size - 2**20))
                h.update(fh.read())
        out[f"{label} file {f.name}"] = f"{size} bytes, sha256 {h.hexdigest()[:16]}"
    return out


class AgreedCalibration(CalibrationCache):
    """The calibration cache of one rank: the ranks measure together (every forward is a
    collective), so a rank uses its cached costs only when every rank has its own."""

    def __init__(self, group: Any, folder: str | Path | None, fingerprint: str) -> None:
        super().__init__(folder, fingerprint)
        self.group = group

    def fetch(self, kind: str, cls: type[T], measure: Callable[[], T], **params: Any) -> T:
        value = self.cached(kind, cls, **params)
        if everyone(self.group, value is not None) and value is not None:
            return value
        value = measured(kind, measure, self.folder is not None)
        self.keep(kind, value, **params)
        return value


class Watchdog:
    """Bounds each round: one open longer than ``timeout_s`` means a rank hung (a collective
    never returns), and ``on_hang(message)`` runs once, on the watchdog's own thread, since the
    round's thread is stuck inside MLX and cannot be interrupted."""

    def __init__(self, timeout_s: float, on_hang: Callable[[str], None]) -> None:
        self.timeout_s, self.on_hang = timeout_s, on_hang
        self._since: float | None = None
        self._fired = False
        threading.Thread(target=self._watch, name="dflash-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while not self._fired:
            time.sleep(min(1.0, self.timeout_s / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._fired = True
                self.on_hang(
                    f"a round took over {self.timeout_s:g} s (--rank-timeout): another rank "
                    "stopped answering; restart every rank"
                )
