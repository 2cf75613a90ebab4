"""A drafter layer's context K/V cache: committed positions only, never block K/V.

See docs/design.md, "The drafter's forward pass".
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class DraftContext(Protocol):
    """One drafter layer's context cache: committed positions only, so it never rolls back.
    Prefix snapshots save and restore it (``generation/prefix.py``)."""

    @property
    def offset(self) -> int:  # positions seen: the absolute position of the next one
        ...

    @property
    def max_size(self) -> int | None:  # a window: its state is valid only where it was taken
        ...

    @property
    def state(self) -> list[mx.array]: ...

    def snapshot(self) -> tuple[mx.array, mx.array, int] | None:
        """The live keys and values, and the offset they end at (None: empty)."""
        ...

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None: ...


class ContextCache:
    """One draft layer's context K/V (after RoPE): buffer row r holds absolute position
    ``start + r``; the live entries are the newest ``size`` of positions ``start .. offset - 1``.

    ``max_size`` keeps only the newest positions (a sliding layer keeps ``window - 1``: all that
    block position 0 can see), so memory stays bounded. The buffer grows ``step`` positions at a
    time like mlx-lm's ``KVCache``, so an append costs O(new positions), amortised. Save and
    load it with ``snapshot``/``restore`` (a windowed buffer does not start at position 0).
    """

    step = 256

    def __init__(self, max_size: int | None = None):
        self.max_size = max_size
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # positions seen so far = absolute position of the next one
        self.start = 0  # absolute position of buffer row 0

    @property
    def size(self) -> int:
        used = self.offset - self.start
        return used if self.max_size is None else min(used, self.max_size)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    def skip(self, n: int) -> None:
        """Advance past ``n`` positions no query can see; the next append must refill the window."""
        self.offset += n
        self.start = self.offset

    def append(self, keys: mx.array, values: mx.array) -> None:
        S, used = keys.shape[2], self.offset - self.start
        held_k, held_v = self.keys, self.values
        if held_k is not None and held_v is not None and used + S <= held_k.shape[2]:
            held_k[..., used : used + S, :] = keys
            held_v[..., used : used + S, :] = values
            self.offset += S
            return
        keep = self.size if self.max_size is None else max(0, min(self.size, self.max_size - S))
        old = slice(used - keep, used)
        ks, vs = [keys], [values]
        if keep and held_k is not None and held_v is not None:
            ks, vs = [held_k[..., old, :], keys], [held_v[..., old, :], values]
        k, v = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
        if self.max_size is not None:
            k, v = k[..., -self.max_size :, :], v[..., -self.max_size :, :]
        self.offset += S
        self.start = self.offset - k.shape[2]
        pad = [*k.shape[:2], self.step, k.shape[3]]
        self.keys = mx.concatenate([k, mx.zeros(pad, k.dtype)], axis=2)
        self.values = mx.concatenate([v, mx.zeros(pad, v.dtype)], axis=2)

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The live context K/V, oldest first (what a block at ``offset`` may attend to)."""
        if self.keys is None or self.values is None or self.size == 0:
            return None
        rows = slice(self.offset - self.start - self.size, self.offset - self.start)
        return self.keys[..., rows, :], self.values[..., rows, :]

    def snapshot(self) -> tuple[mx.array, mx.array, int] | None:
        """Own copies of the live entries plus ``offset``; ``restore`` puts them back."""
        live = self.fetch()
        if live is None:
            return None
        return mx.contiguous(live[0]), mx.contiguous(live[1]), self.offset

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None:
        if snapshot is None:
            self.keys = self.values = None
            self.offset = self.start = 0
            return
        self.keys, self.values, self.offset = snapshot
        self.start = self.offset - self.keys.shape[2]  # no spare rows: the next append regrows
