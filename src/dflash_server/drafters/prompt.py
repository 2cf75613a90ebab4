"""What of a long prompt a drafter reads: a windowed drafter's context needs no other position.

A drafter whose every layer is windowed (``context_window()`` not None: the server's sink window
on full layers, trained windows on sliding ones) reads its first ``sinks`` positions and the newest
``newest``. Prefilling a 32k-token prompt, it only ever reads the window before the prompt's
end, and the window before each checkpoint (a prefix-cache snapshot keeps it there); the
positions in between are skipped, never projected (docs/design.md, "Drafter window").
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dflash_server.drafters.protocol import Drafter


def prompt_reads(
    draft: Drafter, length: int, checkpoints: set[int]
) -> list[tuple[int, int]] | None:
    """The positions of a ``length``-token prompt ``draft`` will read, as sorted disjoint
    ranges (its sinks, and its window before the end and before each checkpoint); None: all."""
    window = draft.context_window()
    if window is None:
        return None
    newest, sinks = window
    ends = {*checkpoints, length}
    ranges = sorted([(0, sinks)] + [(max(0, p - newest), p) for p in ends])
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def feed_prompt(
    draft: Drafter,
    cache: list[Any],
    taps: mx.array,
    tokens: mx.array,
    span: tuple[int, int],
    reads: list[tuple[int, int]] | None,
) -> None:
    """Give ``draft`` the prompt positions ``span`` (``taps`` [1, T, L*H] of that span,
    ``tokens`` the whole prompt's): the ones it reads (all, with ``reads`` None), skipping the
    rest in order."""
    begin, end = span
    if reads is None:
        draft.append_context(taps, cache, tokens[begin:end])
        return
    at = begin
    for lo, hi in reads:
        lo, hi = max(lo, at), min(hi, end)
        if lo >= hi:
            continue
        if lo > at:
            draft.skip_context(lo - at, cache)
        draft.append_context(taps[:, lo - begin : hi - begin], cache, tokens[lo:hi])
        at = hi
    if at < end:
        draft.skip_context(end - at, cache)
