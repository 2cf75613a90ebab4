"""Several rows' DFlash blocks in one drafter pass (a batch's drafting rows).

Each row keeps its own context cache (committed positions only). In one forward, each row's
context K/V is left-padded to the longest, its block right-padded to the widest, and a mask hides
the padding, so a row's block sees exactly what it sees alone (its own context and its own
block, bidirectionally), with RoPE at its own positions. This holds for full-attention,
bidirectional layers over a whole context or the server's sink window (which drops old context
itself); ``DFlashDraftModel.propose_rows`` runs other layouts row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class DraftRow:
    """What one row drafts from: a ``Drafter.propose`` call's arguments."""

    drafter: Any  # the row's drafter (``generation.protocols.Drafter``)
    block: mx.array  # [1, width]: [anchor, mask, ...]
    context: mx.array | None  # new committed positions' taps
    cache: list[Any]  # the row's context cache, one per drafter layer
    sampler: Any  # the row's ``DraftSampler``
    history: mx.array | None  # the penalties' window

    def propose(self) -> tuple[mx.array, mx.array | None]:
        """This row alone: (drafts, log q)."""
        return self.drafter.propose(self.block, self.context, self.cache, self.sampler,
                                    self.history)  # fmt: skip


def block_logits_together(model: Any, bound: Any, rows: Sequence[DraftRow]) -> list[mx.array]:
    """Each row's block logits ([1, width - 1, V]) from one pass of ``model`` (a
    ``DFlashDraftModel`` whose layers qualify, see the module docstring; ``bound``: the
    target's embedding and head it borrowed)."""
    for row in rows:  # each row's new context joins its own cache first
        if row.context is not None and row.context.shape[1] > 0:
            model.append_context(row.context, row.cache)
    widths = [row.block.shape[1] for row in rows]
    width = max(widths)
    mask_id = model.config.mask_token_id
    blocks = [
        mx.concatenate([r.block[0], mx.full((width - w,), mask_id, r.block.dtype)])
        for r, w in zip(rows, widths)
    ]
    h = bound.embed_tokens(mx.stack(blocks))
    offsets = mx.array([row.cache[0].offset for row in rows])
    block_cols = mx.arange(width)[None] < mx.array(widths)[:, None]
    for index, layer in enumerate(model.layers):
        contexts = [row.cache[index].fetch() for row in rows]
        if any(ctx is None for ctx in contexts):
            raise RuntimeError("a drafting row has no context (its prefill fed none)")
        lengths = [ctx[0].shape[2] for ctx in contexts]
        longest = max(lengths)
        # [rows, 1, width, longest + width]: a row's own context, then its own block.
        ctx_cols = mx.arange(longest)[None] >= mx.array([longest - n for n in lengths])[:, None]
        visible = mx.concatenate([ctx_cols, block_cols], axis=1)[:, None, None, :]
        visible = mx.broadcast_to(visible, (len(rows), 1, width, longest + width))
        h = _layer(layer, h, contexts, lengths, longest, offsets, visible)
    logits = bound.logits(model.norm(h)[:, 1:])
    return [logits[i : i + 1, : w - 1] for i, w in enumerate(widths)]


def _padded(contexts: list[Any], lengths: list[int], longest: int, part: int) -> mx.array:
    rows = []
    for ctx, n in zip(contexts, lengths):
        x = ctx[part]
        if n < longest:
            pad = mx.zeros((*x.shape[:2], longest - n, x.shape[3]), x.dtype)
            x = mx.concatenate([pad, x], axis=2)
        rows.append(x)
    return mx.concatenate(rows, axis=0)


def _layer(
    layer: Any,
    x: mx.array,
    contexts: list[Any],
    lengths: list[int],
    longest: int,
    offsets: mx.array,
    visible: mx.array,
) -> mx.array:
    attn = layer.self_attn
    R, L, _ = x.shape
    y = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(y).reshape(R, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    k = attn.k_norm(attn.k_proj(y).reshape(R, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(y).reshape(R, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q, offset=offsets), attn.rope(k, offset=offsets)
    keys = mx.concatenate([_padded(contexts, lengths, longest, 0), k], axis=2)
    values = mx.concatenate([_padded(contexts, lengths, longest, 1), v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=visible)
    h = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(R, L, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))
