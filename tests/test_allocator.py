"""Freed memory goes back to the system: the worker trims glibc's heaps after its rounds, every
30 s while busy and when it falls idle (at most every 2 s), never more often."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from dflash_server.engine import allocator


class FakeLibc:
    def __init__(self) -> None:
        self.calls = 0

    def malloc_trim(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        return 1


def test_trims_on_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(allocator.time, "monotonic", lambda: now[0])
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    trimmer = allocator.Trimmer(every_s=30.0, idle_s=2.0)
    assert not trimmer.maybe() and not trimmer.maybe(idle=True)  # just started
    now[0] += 2.5
    assert not trimmer.maybe()  # busy: waits for every_s
    assert trimmer.maybe(idle=True) and libc.calls == 1  # idle: sooner
    assert not trimmer.maybe(idle=True)  # not twice in a row
    now[0] += 30
    assert trimmer.maybe() and libc.calls == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_real_trim_runs() -> None:
    trimmer = allocator.Trimmer(every_s=0.0, idle_s=0.0)
    assert trimmer.available and trimmer.maybe() and trimmer.trims == 1


def test_nothing_to_trim_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    trimmer: Any = allocator.Trimmer(every_s=0.0, idle_s=0.0)
    assert not trimmer.available and not trimmer.maybe()
