"""A bounded drafter context: a few "sink" positions plus the newest ones.

See docs/design.md, "Drafter window".

A DFlash drafter's full-attention layers attend to every committed position, so drafting costs
more with every token of a long context (attention over the context K/V, and its memory). With
a window ``W`` and ``s`` sinks, such a layer keeps the first ``s`` positions (attention sinks:
models lean on the first tokens, and they hold the start of the prompt) and the newest
``W - s``; the middle is dropped. Keys keep the absolute positions RoPE gave them, so what a
layer sees is a subset of what it saw before, never moved. Sliding layers keep their own
trained window, which already bounds them.

Windowing changes which drafts are proposed, never which tokens are committed: verification
is unchanged, so output stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from dflash_server.drafters.context import ContextCache

SINKS = 4  # sink positions kept at the start of the context
DEFAULT_WINDOW = 4096  # the server's default when the drafter's config names none


class SinkContextCache(ContextCache):
    """A full-attention layer's context K/V bounded to ``sinks`` + the newest ``window - sinks``
    positions. ``max_size`` is the newest part's bound, so prefix snapshots treat it as a
    windowed cache (restorable at checkpoints only); ``snapshot`` holds sinks then newest."""

    def __init__(self, window: int, sinks: int = SINKS):
        if window <= sinks:
            raise ValueError(f"draft window {window} must exceed its {sinks} sink positions")
        super().__init__(max_size=window - sinks)
        self.sinks = sinks
        self.sink_keys: mx.array | None = None
        self.sink_values: mx.array | None = None

    @property
    def _held_sinks(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    def append(self, keys: mx.array, values: mx.array) -> None:
        have = self._held_sinks
        if have < self.sinks and self.offset == have:  # still filling the sinks
            take = min(self.sinks - have, keys.shape[2])
            new_k, new_v = keys[..., :take, :], values[..., :take, :]
            if self.sink_keys is None or self.sink_values is None:
                self.sink_keys, self.sink_values = mx.contiguous(new_k), mx.contiguous(new_v)
            else:
                self.sink_keys = mx.concatenate([self.sink_keys, new_k], axis=2)
                self.sink_values = mx.concatenate([self.sink_values, new_v], axis=2)
        super().append(keys, values)

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        recent = super().fetch()
        if self.sink_keys is None or self.sink_values is None:
            return recent
        if recent is None:  # restored with nothing but sinks
            return self.sink_keys, self.sink_values
        # The newest part may still overlap the sinks (short contexts): drop the overlap.
        overlap = max(0, self._held_sinks - (self.offset - self.size))
        keys, values = recent[0][..., overlap:, :], recent[1][..., overlap:, :]
        return (
            mx.concatenate([self.sink_keys, keys], axis=2),
            mx.concatenate([self.sink_values, values], axis=2),
        )

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None:
        self.sink_keys = self.sink_values = None
        if snapshot is None:
            super().restore(None)
            return
        keys, values, offset = snapshot
        n = min(self.sinks, offset, keys.shape[2])
        if n:
            self.sink_keys, self.sink_values = keys[..., :n, :], values[..., :n, :]
        rest = (keys[..., n:, :], values[..., n:, :], offset)
        if rest[0].shape[2] == 0:  # only sinks so far
            super().restore(None)
            self.offset = self.start = offset
        else:
            super().restore(rest)


@dataclass(frozen=True)
class SinkWindow:
    """The server's bound on a full-attention layer's context: ``size`` positions, the first
    ``sinks`` of them and the newest ``size - sinks``."""

    size: int
    sinks: int = SINKS

    def __post_init__(self) -> None:
        if self.size <= self.sinks:
            raise ValueError(
                f"draft window must be > {self.sinks} (its sink positions), got {self.size}"
            )

    @classmethod
    def of(cls, window: int | None) -> SinkWindow | None:
        """The window ``--draft-window`` asks for (None or 0: the whole context)."""
        return cls(window) if window else None

    def cache(self) -> SinkContextCache:
        return SinkContextCache(self.size, self.sinks)
