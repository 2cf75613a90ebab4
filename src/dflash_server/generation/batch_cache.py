"""Target caches for a batch of requests of different lengths, with per-row rollback.

Attention layers share one ``RowLayout``: every row writes the same columns of its K/V buffer in
a pass (a verify block, right-padded to the widest row), and afterwards each row keeps only its
own committed prefix of them. Rejected columns are marked invalid and never attended again (a
mask, not zeroed keys: a zero key would still add e^0 to the softmax; docs/design.md,
"Batching under speculation"); the next pass writes from the end of the longest kept prefix, so
a row only leaves holes where another row kept more. Holes are squeezed out when they outgrow
the tokens held (``compact``). Each row has its own RoPE position (``offset``), the number of
tokens it holds.

Gated DeltaNet layers keep mlx-lm's ``ArraysCache`` with one state row per request; after a
recorded verify each row's state is the one after its own kept prefix (``rollback_rows``).
Rows join after their prefill (their caches are moved in) and leave when they finish. A pass
writes its columns in place; the buffers are copied only when they grow (``step`` columns at a
time), when a row joins or leaves, and when holes are squeezed out.

With ``--kv-bits`` the attention buffers are mx.quantize's (data, scales, biases), written in
place like mlx-lm's ``QuantizedKVCache`` (``QuantizedRaggedKVCache``): the whole batch switches
when its longest row reaches the start (``BatchCache.quantize_due``), and a full-precision row
joining a quantized batch is quantized on the way in.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from dflash_server.generation.kv_quant import KVQuant
from dflash_server.models.recurrence import BlockStates

ATTENTION = (KVCache, QuantizedKVCache)
# An attention buffer: one array, or mx.quantize's (data, scales, biases) for a quantized layer.
Buffer = Any


def batchable(cache: list[Any]) -> bool:
    """Whether a request's (prefilled) cache can join a batch: KV (quantized or not) and Gated
    DeltaNet."""
    return all(type(c) in (*ATTENTION, ArraysCache) for c in cache)


def _map(buf: Buffer, f: Any) -> Buffer:
    # (mlx-lm's QuantizedKVCache holds mx.quantize's parts as a list: read as a tuple)
    return tuple(f(a) for a in buf) if isinstance(buf, tuple | list) else f(buf)


def _parts(buf: Buffer) -> list[mx.array]:
    return list(buf) if isinstance(buf, tuple | list) else [buf]


def _cols(a: mx.array, n: int) -> mx.array:
    """``n`` zero columns shaped like ``a``'s (zeros stay finite once dequantized)."""
    return mx.zeros((*a.shape[:2], n, a.shape[3]), a.dtype)


class RowLayout:
    """Which buffer columns each row may attend to, shared by every attention layer."""

    step = 256

    def __init__(self) -> None:
        self.rows = 0
        self.idx = 0  # the next pass writes from this column (every row)
        self.capacity = 0
        self.valid = mx.zeros((0, 0), dtype=mx.bool_)  # [rows, capacity]
        self.offset = mx.zeros((0,), dtype=mx.int32)  # [rows] tokens held = next RoPE position
        self.lengths: list[int] = []  # host copy of ``offset``

    def reserve(self, width: int) -> None:
        """Make room for a pass of ``width`` columns."""
        if self.idx + width > self.capacity:
            grow = self.step * ((self.idx + width - self.capacity + self.step - 1) // self.step)
            pad = mx.zeros((self.rows, grow), dtype=mx.bool_)
            self.valid = mx.concatenate([self.valid, pad], axis=1)
            self.capacity += grow

    def make_mask(self, n: int) -> mx.array:
        """[rows, 1, n, idx + n]: the valid past columns, then causal within the new block."""
        past = mx.broadcast_to(self.valid[:, None, : self.idx], (self.rows, n, self.idx))
        causal = mx.tril(mx.ones((n, n), dtype=mx.bool_))
        block = mx.broadcast_to(causal[None], (self.rows, n, n))
        return mx.concatenate([past, block], axis=2)[:, None]

    def commit(self, keep: list[int], fed: int) -> None:
        """A pass wrote ``fed`` columns; row i keeps its first ``keep[i]``."""
        cols = mx.arange(self.capacity)[None]
        kept = mx.array(keep, dtype=mx.int32)[:, None]
        written = (cols >= self.idx) & (cols < self.idx + kept)
        self.valid = self.valid | written
        self.offset = self.offset + kept[:, 0]
        self.lengths = [n + k for n, k in zip(self.lengths, keep)]
        self.idx += max(keep)

    def hole_share(self) -> float:
        """Columns in use that no row attends to, per column in use."""
        if not self.rows or not self.idx:
            return 0.0
        return 1.0 - sum(self.lengths) / (self.rows * self.idx)


class RaggedKVCache:
    """One attention layer's K/V for all rows (``[rows, heads, capacity, dim]``), written at the
    layout's shared column; the mlx-lm attention layers call it like a ``KVCache``."""

    def __init__(self, layout: RowLayout) -> None:
        self.layout = layout
        self.keys: Buffer = None  # set once a row joined
        self.values: Buffer = None

    @property
    def offset(self) -> mx.array:
        return self.layout.offset

    def _encode(self, x: mx.array) -> Buffer:
        return x

    def _fit(self) -> None:
        """Grow the buffers to the layout's capacity (new columns are never valid)."""
        if self.keys is None:
            return
        grow = self.layout.capacity - _parts(self.keys)[0].shape[2]
        if grow > 0:
            self.keys, self.values = (
                _map(buf, lambda a: mx.concatenate([a, _cols(a, grow)], axis=2))
                for buf in (self.keys, self.values)
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        keys, values = self._encode(keys), self._encode(values)
        if self.keys is None:  # rows that hold no tokens yet (a batched prefill's)
            self.keys, self.values = (
                _map(x, lambda a: _cols(a, self.layout.capacity)) for x in (keys, values)
            )
        self._fit()
        start, n = self.layout.idx, _parts(keys)[0].shape[2]
        for buf, new in ((self.keys, keys), (self.values, values)):
            for into, x in zip(_parts(buf), _parts(new)):
                into[..., start : start + n, :] = x
        return self._upto(start + n)

    def _upto(self, end: int) -> tuple[Buffer, Buffer]:
        keys, values = (_map(b, lambda a: a[..., :end, :]) for b in (self.keys, self.values))
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, **_: Any) -> mx.array:
        # [rows, 1, n, T]; mlx-lm's quantized attention adds the repeats axis itself
        # (mask.ndim > 3 -> [rows, 1, 1, n, T]).
        return self.layout.make_mask(n)

    def is_trimmable(self) -> bool:
        return False  # rows are cut by ``RowLayout.commit``, never by a uniform trim

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else _parts(self.keys) + _parts(self.values)


class QuantizedRaggedKVCache(RaggedKVCache):
    """The same, quantized: new keys and values are quantized as they are written (mlx-lm's
    ``QuantizedKVCache.update_and_fetch``); ``bits`` and ``group_size`` make mlx-lm's
    ``scaled_dot_product_attention`` take its quantized path."""

    def __init__(self, layout: RowLayout, bits: int, group_size: int) -> None:
        super().__init__(layout)
        self.bits, self.group_size = bits, group_size

    def _encode(self, x: mx.array) -> Buffer:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    @classmethod
    def of(cls, plain: RaggedKVCache, kv: KVQuant) -> QuantizedRaggedKVCache:
        """A full-precision layer's buffers, quantized (each token's groups on their own, so
        the same as if every token had been quantized when written)."""
        out = cls(plain.layout, kv.bits, kv.group_size)
        if plain.keys is not None:
            out.keys, out.values = out._encode(plain.keys), out._encode(plain.values)
        return out


class BatchCache:
    """The target cache of a batch: a ``RaggedKVCache`` per attention layer and a batched
    ``ArraysCache`` per Gated DeltaNet layer, in layer order (what the model is called with).
    ``kv``: the quantization the batch switches to (``quantize_due``)."""

    def __init__(self, kinds: list[type], kv: KVQuant | None = None) -> None:
        self.layout = RowLayout()
        self.kv, self.quantized = kv, False
        self.layers: list[Any] = [
            RaggedKVCache(self.layout) if kind in ATTENTION else ArraysCache(2) for kind in kinds
        ]
        self.linear = [c for c in self.layers if isinstance(c, ArraysCache)]

    @classmethod
    def empty(cls, kinds: list[type], rows: int) -> BatchCache:
        """``rows`` rows holding no tokens yet (a batched prefill's, full precision)."""
        cache = cls(kinds)
        lay = cache.layout
        lay.rows, lay.lengths = rows, [0] * rows
        lay.valid = mx.zeros((rows, 0), dtype=mx.bool_)
        lay.offset = mx.zeros((rows,), dtype=mx.int32)
        return cache

    @property
    def rows(self) -> int:
        return self.layout.rows

    def state(self) -> list[mx.array]:
        out = [self.layout.valid, self.layout.offset]
        for c in self.layers:  # (a KV layer's state: its arrays, quantized parts included)
            out += (
                c.state if isinstance(c, RaggedKVCache) else [x for x in c.cache if x is not None]
            )
        return out

    def quantize_due(self) -> None:
        """Before a pass: the batch's KV becomes quantized once its longest row holds the
        start (all rows switch together: one buffer per layer)."""
        if (
            self.kv is not None
            and not self.quantized
            and max(self.layout.lengths, default=0) >= (self.kv.start)
        ):
            self._quantize()

    def _quantize(self) -> None:
        assert self.kv is not None
        kv = self.kv
        self.layers = [
            QuantizedRaggedKVCache.of(c, kv) if isinstance(c, RaggedKVCache) else c
            for c in self.layers
        ]
        self.quantized = True

    def add_row(self, cache: list[Any]) -> None:
        """Move a prefilled request's cache in as the last row (its KV ends at column idx)."""
        lay = self.layout
        length = next((c.offset for c in cache if isinstance(c, ATTENTION)), 0)
        if any(isinstance(c, QuantizedKVCache) for c in cache) and not self.quantized:
            self._quantize()  # the row switched already: so does the batch
        if lay.idx < length:  # room on the left for the new row's prompt
            self._shift(length - lay.idx)
        lay.reserve(0)
        cols = mx.arange(lay.capacity)
        row_valid = (cols >= lay.idx - length) & (cols < lay.idx)
        for mine, theirs in zip(self.layers, cache):
            if isinstance(mine, RaggedKVCache):
                mine._fit()
                own_keys, own_values = _own_kv(mine, theirs, length)
                mine.keys, mine.values = (
                    _append_row(mine_buf, own, lay.idx, lay.capacity)
                    for mine_buf, own in ((mine.keys, own_keys), (mine.values, own_values))
                )
            elif lay.rows:
                mine.cache = [mx.concatenate([a, x]) for a, x in zip(mine.cache, theirs.cache)]
            else:
                mine.cache = list(theirs.cache)
        lay.valid = mx.concatenate([lay.valid, row_valid[None]], axis=0)
        lay.offset = mx.concatenate([lay.offset, mx.array([length], dtype=mx.int32)])
        lay.lengths.append(length)
        lay.rows += 1

    def remove_row(self, row: int) -> None:
        lay = self.layout
        keep = mx.array([i for i in range(lay.rows) if i != row], dtype=mx.int32)
        lay.rows -= 1
        lay.lengths.pop(row)
        if lay.rows == 0:  # an empty batch starts afresh
            fresh = BatchCache([ArraysCache if isinstance(c, ArraysCache) else KVCache
                                for c in self.layers], self.kv)  # fmt: skip
            self.layout, self.layers, self.linear = fresh.layout, fresh.layers, fresh.linear
            self.quantized = False
            return
        lay.valid, lay.offset = lay.valid[keep], lay.offset[keep]
        for c in self.layers:
            if isinstance(c, RaggedKVCache):
                if c.keys is not None:
                    c.keys, c.values = (_map(b, lambda a: a[keep]) for b in (c.keys, c.values))
            else:
                c.cache = [None if x is None else x[keep] for x in c.cache]
        if lay.hole_share() > 0.5:
            self.compact()

    def _shift(self, n: int) -> None:
        """Insert ``n`` never-valid columns on the left of every buffer."""
        lay = self.layout
        lay.valid = mx.concatenate([mx.zeros((lay.rows, n), dtype=mx.bool_), lay.valid], axis=1)
        lay.capacity += n
        lay.idx += n
        for c in self.layers:
            if isinstance(c, RaggedKVCache) and c.keys is not None:
                c.keys, c.values = (
                    _map(b, lambda a: mx.concatenate([_cols(a, n), a], axis=2))
                    for b in (c.keys, c.values)
                )

    def compact(self) -> None:
        """Squeeze the holes out: each row's valid columns, in order, right-aligned at the new
        write column (one gather per buffer; RoPE positions are unchanged)."""
        lay = self.layout
        valid = np.array(lay.valid[:, : lay.idx], dtype=bool)
        longest = max(lay.lengths)
        index = np.zeros((lay.rows, longest), dtype=np.int32)
        for i, row in enumerate(valid):
            cols = np.nonzero(row)[0]
            index[i, longest - len(cols) :] = cols
        gather = mx.array(index)[:, None, :, None]
        for c in self.layers:
            if isinstance(c, RaggedKVCache) and c.keys is not None:
                c.keys, c.values = (
                    _map(b, lambda a: mx.take_along_axis(a, gather, axis=2))
                    for b in (c.keys, c.values)
                )
        starts = mx.array([longest - n for n in lay.lengths])[:, None]
        lay.valid = mx.arange(longest)[None] >= starts
        lay.idx = lay.capacity = longest
        mx.eval(self.state())


def _own_kv(mine: RaggedKVCache, theirs: Any, length: int) -> tuple[Buffer, Buffer]:
    """A joining row's first ``length`` keys and values, in the batch layer's form (a
    full-precision row joining a quantized batch is quantized on the way in)."""
    keys, values = (_map(b, lambda a: a[..., :length, :]) for b in (theirs.keys, theirs.values))
    if isinstance(mine, QuantizedRaggedKVCache) and not isinstance(theirs, QuantizedKVCache):
        keys, values = mine._encode(keys), mine._encode(values)
    return keys, values


def _append_row(batch: Buffer, own: Buffer, end: int, capacity: int) -> Buffer:
    """``own`` ([1, heads, n, dim], or its quantized parts) placed to end at column ``end`` of
    a new last row."""
    if batch is None:
        batch = _map(own, lambda a: a[:0])
    rows = []
    for b, a in zip(_parts(batch), _parts(own)):
        n = a.shape[2]
        row = mx.concatenate([_cols(a, end - n), a, _cols(a, capacity - end)], axis=2)
        rows.append(row if b.shape[0] == 0 else mx.concatenate([b, row]))
    return tuple(rows) if isinstance(own, tuple | list) else rows[0]


def states_at_rows(states: BlockStates | list[mx.array], keep: mx.array) -> mx.array:
    """Each row's recurrent state after its own first ``keep[i]`` (>= 1) recorded tokens."""
    if not isinstance(states, BlockStates):
        stacked = mx.stack(states)  # [T, B, ...]
        return stacked[keep - 1, mx.arange(keep.shape[0])]
    T = states.log_g.shape[-1]
    last_index = mx.broadcast_to((keep - 1)[:, None, None], (*states.log_g.shape[:2], 1))
    last = mx.take_along_axis(states.log_g, last_index, axis=-1)  # [B, H, 1]
    inside = mx.arange(T)[None, None] < keep[:, None, None]
    weight = mx.where(inside, mx.exp(last - states.log_g), 0.0)[..., None]
    kept = (states.u * weight).swapaxes(-1, -2) @ states.k
    return mx.exp(last)[..., None] * states.initial + kept


def rollback_rows(hooks: Any, cache: BatchCache, recording: Any, keep: list[int], fed: int) -> None:
    """After a recorded pass of ``fed`` positions, set each Gated DeltaNet row to the state after
    its own first ``keep[i]`` positions (conv window re-sliced per row from the recorded input)."""
    if not cache.linear or all(k == fed for k in keep):
        return
    if len(recording.updates) != len(cache.linear):
        raise RuntimeError("batched rollback needs the recording of the last verify pass")
    kept = mx.array(keep, dtype=mx.int32)
    for c, gdn, (args, kwargs, states), conv_input in zip(
        cache.linear, hooks.gdn, recording.updates, recording.conv_inputs
    ):
        if states is not None:
            c[1] = states_at_rows(states, kept)
        else:  # a fused kernel kept only the inputs: replay, each row up to its own prefix
            q, k, v, a, b, A_log, dt_bias, state = args[:8]
            mask = mx.arange(fed)[None] < kept[:, None]
            options = {key: val for key, val in kwargs.items() if key != "mask"}
            _, c[1] = hooks.replay(gdn)(q, k, v, a, b, A_log, dt_bias, state, mask, **options)
        window = conv_input.shape[1] - fed
        rows = (kept[:, None] + mx.arange(window)[None])[..., None]
        c[0] = mx.take_along_axis(conv_input, rows, axis=1)
