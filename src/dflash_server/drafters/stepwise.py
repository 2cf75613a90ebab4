"""Drafting token by token for several rows at once: the MTP head, EAGLE-3 and DSpark's Markov
head draw each draft from the one before, and run every row's step in one pass.

* ``Walk`` draws the rows' drafts one position at a time from ``[rows, V]`` logits, each row with
  its own sampler (its q: the law it drew from), rows whose block has ended carried along.
* ``batch_of`` reads several rows' drafter K/V (mlx-lm ``KVCache``s over committed positions) as
  one mlx-lm ``BatchKVCache``: copied, left-padded (its mask hides each row's padding, its
  per-row offsets give each row its own RoPE positions). Drafting steps append to the copy, which
  is dropped after, so the rows' caches never change (docs/design.md, "Drafter families").
* ``ShiftedContext`` and ``PendingHidden``: the context of a head that pairs each committed
  position's hidden state with the token after it (the MTP head, EAGLE-3): its layers' K/V, one
  entry short, and the newest position's hidden state waiting for that token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from dflash_server.drafters.protocol import ContextLayer, Drafted, DraftRow
from dflash_server.models.target_parts import float_bytes


class Walk:
    """The rows' drafts, drawn one position at a time; ``last``: each row's newest token
    ([rows], the anchors to begin with)."""

    def __init__(self, rows: Sequence[DraftRow]):
        self.rows = rows
        self.last = mx.concatenate([row.block[0, :1] for row in rows]).astype(mx.int32)
        self.steps = max(row.width for row in rows) - 1  # the widest row's drafts
        self._drafts: list[list[mx.array]] = [[] for _ in rows]
        self._log_qs: list[list[mx.array]] = [[] for _ in rows]

    def draw(self, logits: mx.array) -> mx.array:
        """Each row's next draft from its row of ``logits`` ([rows, V]); a row whose block has
        ended keeps its last token. Returns the new ``last``."""
        drawn = []
        for r, row in enumerate(self.rows):
            if len(self._drafts[r]) >= row.width - 1:
                drawn.append(self.last[r : r + 1])
                continue
            draft, log_q = row.sampler.propose(logits[r : r + 1], row.history)
            self._drafts[r].append(draft)
            if log_q is not None:
                self._log_qs[r].append(log_q)
            drawn.append(draft.astype(mx.int32))
        self.last = mx.concatenate(drawn)
        return self.last

    def drafted(self) -> list[Drafted]:
        """Each row's drafts and their log q (None when greedy)."""
        return [
            (mx.concatenate(d) if d else mx.zeros((0,), mx.int32), mx.concatenate(q) if q else None)
            for d, q in zip(self._drafts, self._log_qs)
        ]


def batch_of(caches: Sequence[KVCache]) -> BatchKVCache:
    """One layer's K/V of several rows (``caches``: one per row), left-padded into a batch."""
    lengths = [c.offset for c in caches]
    longest = max(lengths)
    batch = BatchKVCache([longest - n for n in lengths])
    held = next((c for c in caches if c.keys is not None), None)
    if held is None or longest == 0:
        return batch

    def padded(c: KVCache, n: int, which: int) -> mx.array:
        part = (c.keys, c.values)[which]
        if part is None:  # an empty row: all padding, shaped like the others
            template = (held.keys, held.values)[which]
            return mx.zeros((1, template.shape[1], longest, template.shape[3]), template.dtype)
        return mx.pad(part[..., :n, :], [(0, 0), (0, 0), (longest - n, 0), (0, 0)])

    keys = mx.concatenate([padded(c, n, 0) for c, n in zip(caches, lengths)])
    values = mx.concatenate([padded(c, n, 1) for c, n in zip(caches, lengths)])
    batch.state = (keys, values, mx.array(lengths), batch.left_padding, longest)
    return batch


class ShiftedContext(KVCache):
    """A head layer's K/V over committed positions. Position i's entry needs x_{i+1}, so it
    holds one entry fewer than the positions seen: restoring ``length`` prompt tokens keeps the
    first ``length - 1`` entries (the last one's next token may differ)."""

    max_size = None  # cut to any prefix, like a full-attention context

    def snapshot(self) -> tuple[mx.array, mx.array, int] | None:
        if self.keys is None:  # no entry yet (a one-token prompt): an empty context
            empty = mx.zeros((1, 1, 0, 1))
            return empty, empty, 1
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :], self.offset + 1

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None:
        if snapshot is None or snapshot[2] <= 1:
            self.keys = self.values = None
            self.offset = 0
            return
        keys, values, length = snapshot
        self.keys, self.values = keys[..., : length - 1, :], values[..., : length - 1, :]
        self.offset = length - 1


class PendingHidden:
    """The newest committed position's hidden state ([1, 1, H]), until the token after it is
    known. Valid only where it was taken, so prefix snapshots keep it at checkpoints."""

    max_size = 1

    def __init__(self) -> None:
        self.hidden: mx.array | None = None
        self.offset = 0  # positions seen

    @property
    def state(self) -> list[mx.array]:
        return [] if self.hidden is None else [self.hidden]

    def snapshot(self) -> tuple[mx.array, mx.array, int] | None:
        if self.hidden is None:
            return None
        kv = self.hidden[:, None]  # [1, 1, 1, H]: the shape of one position of K/V
        return kv, kv, self.offset

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None:
        self.hidden = None if snapshot is None else snapshot[0][:, 0]
        self.offset = 0 if snapshot is None else snapshot[2]


def row_cache(layers: int) -> list[Any]:
    """A fresh context for one row of a token-by-token drafter: each layer's K/V, then the
    newest committed position's pending state."""
    return [ShiftedContext() for _ in range(layers)] + [PendingHidden()]


def kv_context_layers(layers: Sequence[Any], activation_bytes: int) -> tuple[ContextLayer, ...]:
    """Each attention layer's K/V over every committed position (the pending state is one
    position, not counted), for the KV budget."""
    out = []
    for layer in layers:
        attn = layer.self_attn
        width = attn.k_proj.weight.shape[0] + attn.v_proj.weight.shape[0]
        out.append(ContextLayer(width * max(activation_bytes, float_bytes(attn.k_proj)), None))
    return tuple(out)
