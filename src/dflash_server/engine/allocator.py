"""Giving freed memory back to the system (Linux, glibc).

MLX, Pillow and the tokenizers free their buffers with ``free``, but glibc keeps most freed
memory in its heaps for reuse, one heap (arena) per thread that allocates, up to eight per core:
a server's resident size then creeps up by tens of MB an hour that no cache explains (the soak
measured 34-52 MB; ``malloc_trim(0)`` in the running server gave 47 MB back at once). So the
worker calls ``trim`` when it falls idle, at most every ``IDLE_TRIM_S``: ``malloc_trim(0)``
returns the free pages of every arena (a few milliseconds). Not while busy: the live buffers
between the freed ones keep most pages then, and trimming under load made RSS a sawtooth.

Under continuous load the heaps still crept (about 15 MB in 8 minutes of the soak). Two of
glibc's settings stop that, set once by ``configure`` before the server starts its threads:
two arenas, not eight per core (each keeps its own free pages), and a fixed mmap threshold
(256 KiB): glibc otherwise raises it to the largest block freed so far, and MLX's buffers of a
few MB then land in the heaps, where a live buffer above them keeps their pages. With both, the
soak's server grew 5 MB in 8 minutes, at the same tokens/s. Variables the operator set
(``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``) win. Elsewhere (macOS, musl) nothing happens.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any

IDLE_TRIM_S = 30.0
ARENAS = 2
MMAP_THRESHOLD = 256 * 1024
_M_ARENA_MAX, _M_MMAP_THRESHOLD = -8, -3  # mallopt's parameter numbers (malloc.h)


def _glibc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl)
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def configure() -> dict[str, int]:
    """Set glibc's arena count and mmap threshold for a long-running server (call before its
    threads start); the settings it made (none off glibc, or where the environment set them)."""
    libc = _glibc()
    if libc is None:
        return {}
    made = {}
    for variable, param, value in (
        ("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENAS),
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ):
        if variable not in os.environ and libc.mallopt(param, value) == 1:  # 1: accepted
            made[variable] = value
    return made


class Trimmer:
    """``malloc_trim(0)`` when the caller falls idle, at most once per ``idle_s`` seconds."""

    def __init__(self, idle_s: float = IDLE_TRIM_S) -> None:
        self.idle_s = idle_s
        self._libc = _glibc()
        self._last = time.monotonic()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._libc is not None

    def maybe(self, idle: bool) -> bool:
        """Trim if idle and ``idle_s`` passed since the last time; whether it did."""
        if self._libc is None or not idle or time.monotonic() - self._last < self.idle_s:
            return False
        self._libc.malloc_trim(0)
        self._last = time.monotonic()
        self.trims += 1
        return True


_PROCESS = Trimmer()  # malloc_trim works on the whole process: one schedule for every worker


def trim(idle: bool) -> bool:
    """After a worker's round (``idle``: it has nothing left to do): the process's trim."""
    return _PROCESS.maybe(idle)
