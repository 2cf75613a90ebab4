"""Drafting token by token for several rows at once: the MTP head, EAGLE-3 and DSpark's Markov
head draw each draft from the one before, and run every row's step in one pass.

* ``Walk`` draws the rows' drafts one position at a time from ``[rows, V]`` logits, each row with
  its own sampler (its q: the law it drew from), rows whose block has ended carried along.
* ``batch_of`` reads several rows' drafter K/V (mlx-lm ``KVCache``s over committed positions) as
  one mlx-lm ``BatchKVCache``: copied, left-padded (its mask hides each row's padding, its
  per-row offsets give each row its own RoPE positions). Drafting steps append to the copy, which
  is dropped after, so the rows' caches never change (docs/design.md, "Drafter families").
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from dflash_server.drafters.protocol import Drafted, DraftRow


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
