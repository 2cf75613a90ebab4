"""Start-up that talks: each loading phase that takes over a second says so in one log line,
with its time and the MLX CPU kernels it compiled (docs/operations.md, "Start-up")."""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

log = logging.getLogger("dflash_server")

LONG_S = 1.0  # a phase shorter than this goes unmentioned


def kernel_folder() -> Path:
    """Where MLX's CPU backend keeps the kernels it compiles with the system's C++ compiler on
    first use: a fresh temporary directory (or machine) compiles them again."""
    return Path(tempfile.gettempdir()) / "mlx" / str(getattr(mx, "__version__", "")) / "cpu"


def compiled_kernels(folder: Path | None = None) -> int:
    """How many kernels MLX has compiled and kept so far (0 on a GPU: none are kept here)."""
    folder = folder or kernel_folder()
    try:
        return sum(1 for _ in folder.iterdir())
    except OSError:
        return 0


def announce_kernels() -> None:
    """On MLX's CPU backend with no kernel compiled yet (a fresh machine or temporary
    directory), say why the first phases take long, before they do."""
    if mx.default_device().type == mx.cpu and compiled_kernels() == 0:
        log.info(
            "MLX compiles its CPU kernels on this first start (tens of seconds; kept in %s for "
            "later starts)",
            kernel_folder(),
        )


@contextlib.contextmanager
def phase(what: str, *, long_s: float = LONG_S) -> Iterator[None]:
    """Time the block; when it took ``long_s`` or more, log ``"what: N s"``, naming the kernels
    MLX compiled meanwhile (first use here: the next start finds them built)."""
    kernels, start = compiled_kernels(), time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds < long_s:
        return
    built = compiled_kernels() - kernels
    compiled = (
        f", {built} MLX CPU kernel{'s' if built > 1 else ''} compiled on first use (kept in "
        f"{kernel_folder()}: later starts skip this)"
        if built > 0
        else ""
    )
    log.info("%s: %.1f s%s", what, seconds, compiled)
