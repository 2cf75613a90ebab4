"""Pause points: where long MLX work that is not a request (loading a model, measuring its
costs) lets the worker run other models' passes (docs/design.md, "Several models").

The work calls ``pause()`` between two of its pieces, never inside a timed one; on a thread
that set no hook (a one-model server, the Python API) it does nothing. Work that evaluates
nothing (reading a tokenizer, building a model's modules over lazily read weights) runs
``off_worker``: on a helper thread, while the worker goes on pausing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import mlx.core as mx

log = logging.getLogger("dflash_server")
T = TypeVar("T")
# Runs one round of the worker's other work; whether there was any.
Hook = Callable[[], bool]
_HOOK: ContextVar[Hook | None] = ContextVar("dflash_pause_hook", default=None)
_PROGRESS: ContextVar[Callable[[str], None] | None] = ContextVar("dflash_progress", default=None)
IDLE_WAIT_S = 0.002  # off_worker's wait between two looks when the other models are idle


def pause() -> bool:
    """Let the worker run one round of its other work (nothing when no hook is set); whether
    any ran (other models are streaming: the work holds its pieces short)."""
    hook = _HOOK.get()
    return hook is not None and bool(hook())


def progress(what: str) -> None:
    """Say what the work is doing now (``/health`` shows it while a model loads)."""
    sink = _PROGRESS.get()
    if sink is not None:
        sink(what)


@contextlib.contextmanager
def pausing(hook: Hook, on_progress: Callable[[str], None] | None = None) -> Iterator[None]:
    """Run the block with ``hook`` called at each of its pause points and ``on_progress`` told
    of its progress (this thread only)."""
    token, told = _HOOK.set(hook), _PROGRESS.set(on_progress)
    try:
        yield
    finally:
        _HOOK.reset(token)
        _PROGRESS.reset(told)


def off_worker(work: Callable[[], T]) -> T:
    """``work``'s result, computed on a helper thread while this one keeps pausing (the other
    models' rounds go on); with no hook set, here. ``work`` must evaluate nothing: it may
    build lazy arrays, which it does on this thread's streams, since MLX evaluates an array
    only on the thread that made its stream (docs/development.md, "MLX on other threads").
    Work that evaluates anyway fails there and runs again here."""
    hook = _HOOK.get()
    if hook is None:
        return work()
    devices = [mx.cpu, *([mx.gpu] if mx.is_available(mx.gpu) else [])]
    streams = [mx.default_stream(device) for device in devices]
    done, box = threading.Event(), dict[str, Any]()

    def run() -> None:
        try:
            for stream in streams:  # thread-local defaults; the default device is left alone
                mx.set_default_stream(stream)
            box["value"] = work()
        except BaseException as exc:
            box["error"] = exc
        finally:
            mx.clear_streams()  # its MLX state goes with it (docs/development.md)
            done.set()

    threading.Thread(target=run, name="dflash-load-helper", daemon=True).start()
    while not done.is_set():
        if not hook():  # nothing ran: wait a little rather than spin
            done.wait(IDLE_WAIT_S)
    error = box.get("error")
    if isinstance(error, RuntimeError) and "in current thread" in str(error):
        log.info("loading evaluated an array off the worker (%s): done on the worker", error)
        return work()
    if error is not None:
        raise error
    return box["value"]
