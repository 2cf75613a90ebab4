"""Freed memory goes back to the system: the worker trims glibc's heaps when it falls idle, at
most every 30 s, never while busy; the server starts with two arenas and a fixed mmap
threshold unless the operator set them."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from dflash_server.engine import allocator


class FakeLibc:
    def __init__(self) -> None:
        self.calls = 0
        self.options: dict[int, int] = {}

    def mallopt(self, param: int, value: int) -> int:
        self.options[param] = value
        return 1

    def malloc_trim(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        return 1


def test_trims_on_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(allocator.time, "monotonic", lambda: now[0])
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    trimmer = allocator.Trimmer(idle_s=30.0)
    assert not trimmer.maybe(idle=True)  # just started
    now[0] += 31
    assert not trimmer.maybe(idle=False)  # busy: never
    assert trimmer.maybe(idle=True) and libc.calls == 1
    assert not trimmer.maybe(idle=True)  # not twice within idle_s
    now[0] += 31
    assert trimmer.maybe(idle=True) and libc.calls == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_real_trim_runs() -> None:
    trimmer = allocator.Trimmer(idle_s=0.0)
    assert trimmer.available and trimmer.maybe(idle=True) and trimmer.trims == 1


def test_nothing_to_trim_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    trimmer: Any = allocator.Trimmer(idle_s=0.0)
    assert not trimmer.available and not trimmer.maybe(idle=True)


def test_configure_sets_arenas_and_mmap_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    made = allocator.configure()
    assert made == {"MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 256 * 1024}
    assert libc.options == {-8: 2, -3: 256 * 1024}  # M_ARENA_MAX, M_MMAP_THRESHOLD


def test_the_operators_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert allocator.configure() == {"MALLOC_MMAP_THRESHOLD_": 256 * 1024}
    assert -8 not in libc.options


def test_configure_does_nothing_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.configure() == {}
