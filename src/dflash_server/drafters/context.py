"""A drafter layer's context K/V: committed positions only, never block K/V; one row's
(``ContextCache``), or several rows' read together for one batched pass (``RowContexts``).

See docs/design.md, "The drafter's forward pass".
"""

from __future__ import annotations

import mlx.core as mx


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

    def visible(self, mask: mx.array | None, width: int) -> mx.array | None:
        """A lone row owns every column: ``mask`` as it is."""
        return mask

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None:
        if snapshot is None:
            self.keys = self.values = None
            self.offset = self.start = 0
            return
        self.keys, self.values, self.offset = snapshot
        self.start = self.offset - self.keys.shape[2]  # no spare rows: the next append regrows


class RowContexts:
    """One layer's context for several rows drafting in one pass: each row's live K/V
    left-padded to the longest (so every row's newest entry sits just before its block), each
    block right-padded to the widest, and the columns a row does not own hidden by ``visible``.
    A row's block then sees exactly what it sees alone, at its own positions (``offset``)."""

    def __init__(self, caches: list[ContextCache], widths: list[int]):
        self.caches = caches
        self.offset = mx.array([c.offset for c in caches])
        live = [c.fetch() for c in caches]
        if any(kv is None for kv in live):
            raise RuntimeError("a drafting row has no context (its prefill fed none)")
        self.lengths = [kv[0].shape[2] for kv in live if kv is not None]
        longest = max(self.lengths)
        self.keys = mx.concatenate([_left_pad(kv[0], longest) for kv in live if kv is not None])
        self.values = mx.concatenate([_left_pad(kv[1], longest) for kv in live if kv is not None])
        width = max(widths)
        held = mx.arange(longest)[None] >= mx.array([longest - n for n in self.lengths])[:, None]
        own = mx.arange(width)[None] < mx.array(widths)[:, None]
        self._columns = mx.concatenate([held, own], axis=1)[:, None, None, :]  # [R, 1, 1, S+L]

    def fetch(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    def visible(self, mask: mx.array | None, width: int) -> mx.array:
        """``mask`` ([L, S + L] or None: all) narrowed to each row's own columns."""
        columns = self._columns
        if mask is not None:
            return columns & mask
        rows, _, _, total = columns.shape
        return mx.broadcast_to(columns, (rows, 1, width, total))


def _left_pad(x: mx.array, length: int) -> mx.array:
    n = x.shape[2]
    if n == length:
        return x
    return mx.concatenate([mx.zeros((*x.shape[:2], length - n, x.shape[3]), x.dtype), x], axis=2)
