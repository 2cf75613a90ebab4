"""Prefilled prompt state, taken once and restored into fresh caches (the prefix cache's unit).

Attention KV (target and drafter) can be cut to any shorter prefix; a Gated DeltaNet layer's conv
and recurrent state, and a sliding drafter layer's window, are valid only where they were taken
(docs/design.md, "Prefix cache internals"). So a snapshot holds the KV of the whole prompt plus
that state at a few checkpoint positions, and restores at any checkpoint (at any position when
nothing needs one). MLX arrays are immutable and caches rebind or reallocate on update, so a
restored request never changes the snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

if TYPE_CHECKING:
    from dflash_server.drafters.protocol import DraftContext

KV = tuple[mx.array, mx.array]  # keys, values: [B, heads, tokens, head_dim]
Quantized = tuple[mx.array, mx.array, mx.array]  # mx.quantize's (data, scales, biases)


@dataclass(frozen=True)
class QuantKV:
    """A quantized attention layer's keys and values (``QuantizedKVCache``), kept as they are:
    restoring gives back exactly the state that was taken."""

    keys: Quantized
    values: Quantized
    bits: int
    group_size: int

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    def load(self, length: int) -> QuantizedKVCache:
        """A fresh cache holding the first ``length`` tokens (fresh slices, as ``_load_kv``)."""
        cache: Any = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cut = [a[..., :length, :] for a in self.arrays()]
        cache.keys, cache.values = (cut[0], cut[1], cut[2]), (cut[3], cut[4], cut[5])
        cache.offset = length
        return cache


LayerKV = KV | QuantKV


def supported(cache: list[Any]) -> bool:
    """Whether every layer cache is one a snapshot knows how to take and restore."""
    return all(type(c) in (KVCache, QuantizedKVCache, ArraysCache) for c in cache)


def layer_arrays(pair: LayerKV) -> list[mx.array]:
    return pair.arrays() if isinstance(pair, QuantKV) else list(pair)


def _kv(cache: KVCache | QuantizedKVCache, length: int) -> LayerKV:
    # Own copies: the live buffer keeps being written in place as decoding goes on.
    def cut(a: mx.array) -> mx.array:
        return mx.contiguous(a[..., :length, :])

    if isinstance(cache, QuantizedKVCache):
        keys, values = cast("tuple[Quantized, Quantized]", (cache.keys, cache.values))
        return QuantKV(
            (cut(keys[0]), cut(keys[1]), cut(keys[2])),
            (cut(values[0]), cut(values[1]), cut(values[2])),
            cache.bits,
            cache.group_size,
        )
    return cut(cache.keys), cut(cache.values)


@dataclass
class Checkpoint:
    """The state at one position that cannot be cut out of a longer prefix: each recurrent
    target layer's slots, and each sliding drafter layer's context window (None for the
    drafter's full-attention layers, whose context is cut from the snapshot's)."""

    recurrent: list[list[mx.array | None]]
    draft: list[KV | None] | None = None

    @classmethod
    def take(cls, cache: list[Any], draft_cache: Sequence[DraftContext] | None) -> Checkpoint:
        # ArraysCache rebinds its slots on update: references are enough, no copies.
        recurrent: list[list[Any]] = [list(c.cache) for c in cache if isinstance(c, ArraysCache)]
        draft: list[KV | None] | None = None
        if draft_cache is not None and any(c.max_size for c in draft_cache):
            draft = [_window(c) if c.max_size else None for c in draft_cache]
        return cls(recurrent, draft)

    def arrays(self) -> list[mx.array]:
        out = [a for slots in self.recurrent for a in slots if a is not None]
        return out + [a for pair in self.draft or [] if pair is not None for a in pair]


@dataclass
class PromptSnapshot:
    """The caches after prefilling ``tokens``: KV (target and drafter) for all of them, plus
    ``checkpoints`` (position -> what else restoring there needs)."""

    tokens: tuple[int, ...]
    kv: list[LayerKV | None]  # per target layer; None for recurrent layers
    # Per drafter layer its live context K/V, ending at len(tokens); None without a drafter.
    draft_kv: list[KV] | None
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)

    @classmethod
    def take(
        cls,
        tokens: Sequence[int],
        cache: list[Any],
        draft_cache: Sequence[DraftContext] | None,
        checkpoints: dict[int, Checkpoint],
    ) -> PromptSnapshot:
        n = len(tokens)
        kv = [_kv(c, n) if isinstance(c, KVCache | QuantizedKVCache) else None for c in cache]
        draft_kv = None if draft_cache is None else [_live(c) for c in draft_cache]
        return cls(tuple(tokens), kv, draft_kv, dict(checkpoints))

    def arrays(self) -> list[mx.array]:
        out = [a for pair in self.kv if pair is not None for a in layer_arrays(pair)]
        out += [a for pair in self.draft_kv or [] for a in pair]
        return out + [a for c in self.checkpoints.values() for a in c.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    @property
    def recurrent(self) -> bool:
        """Whether restoring needs a checkpoint (else any prefix can be cut out of the KV)."""
        return any(pair is None for pair in self.kv) or any(
            c.draft is not None for c in self.checkpoints.values()
        )

    def restorable(self, limit: int) -> int:
        """The longest prefix, at most ``limit`` tokens, this snapshot can restore (0: none)."""
        return restorable(min(limit, len(self.tokens)), self.recurrent, self.checkpoints)

    def restore(
        self, length: int, cache: list[Any], draft_cache: Sequence[DraftContext] | None
    ) -> None:
        """Load the state after ``length`` tokens into fresh caches (a quantized layer's cache
        is replaced in the list by the ``QuantizedKVCache`` it was taken from)."""
        checkpoint = self.checkpoints.get(length)
        recurrent = iter(checkpoint.recurrent if checkpoint is not None else [])
        for i, (c, pair) in enumerate(zip(cache, self.kv)):
            if pair is None:
                c.cache = list(next(recurrent))
            elif isinstance(pair, QuantKV):
                cache[i] = pair.load(length)
            else:
                _load_kv(c, pair, length)
        if draft_cache is None:
            return
        assert self.draft_kv is not None, "snapshot taken without the drafter"
        windows = checkpoint.draft if checkpoint is not None and checkpoint.draft else None
        for i, (c, (keys, values)) in enumerate(zip(draft_cache, self.draft_kv)):
            window = windows[i] if windows is not None else None
            if window is not None:
                c.restore((*window, length))
            else:  # full attention: the context from position 0, cut at ``length``
                c.restore((keys[..., :length, :], values[..., :length, :], length))


def _live(cache: DraftContext) -> KV:
    """A drafter layer's live context (keys, values); a prefilled prompt always has some."""
    snapshot = cache.snapshot()
    assert snapshot is not None, "a snapshot is taken after the prompt fed the drafter"
    return snapshot[0], snapshot[1]


def _window(cache: DraftContext) -> KV | None:
    """A sliding drafter layer's live window (keys, values), if it holds any."""
    snapshot = cache.snapshot()
    return None if snapshot is None else (snapshot[0], snapshot[1])


def _load_kv(cache: KVCache, pair: KV, length: int) -> None:
    # Fresh slices: the cache's in-place writes then land in new arrays, never in the snapshot.
    cache.keys, cache.values = pair[0][..., :length, :], pair[1][..., :length, :]
    cache.offset = length


def restorable(limit: int, recurrent: bool, checkpoints: Iterable[int]) -> int:
    """How much of a prefix of ``limit`` tokens a snapshot restores: all of it from KV alone;
    with recurrent state, only up to its last checkpoint at or before ``limit`` (0: none)."""
    if not recurrent:
        return limit
    return max((p for p in checkpoints if p <= limit), default=0)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
