"""Pause points: where long MLX work that is not a request (loading a model, measuring its
costs) lets the worker run other models' passes (docs/design.md, "Several models").

The work calls ``pause()`` between two of its pieces, never inside a timed one; on a thread
that set no hook (a one-model server, the Python API) it does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

_HOOK: ContextVar[Callable[[], None] | None] = ContextVar("dflash_pause_hook", default=None)
_PROGRESS: ContextVar[Callable[[str], None] | None] = ContextVar("dflash_progress", default=None)


def pause() -> None:
    """Let the worker run one round of its other work (nothing when no hook is set)."""
    hook = _HOOK.get()
    if hook is not None:
        hook()


def progress(what: str) -> None:
    """Say what the work is doing now (``/health`` shows it while a model loads)."""
    sink = _PROGRESS.get()
    if sink is not None:
        sink(what)


@contextlib.contextmanager
def pausing(
    hook: Callable[[], None], on_progress: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Run the block with ``hook`` called at each of its pause points and ``on_progress`` told
    of its progress (this thread only)."""
    token, told = _HOOK.set(hook), _PROGRESS.set(on_progress)
    try:
        yield
    finally:
        _HOOK.reset(token)
        _PROGRESS.reset(told)
