"""One drafter pass for the drafting rows of a batch.

Each row keeps its own context cache (committed positions only). For the plain DFlash drafter
(full-attention layers, no window) the rows' blocks run in one forward: each row's context K/V
left-padded to the longest, its block right-padded to the widest, and a mask that hides the
padding, so a row's block sees exactly what it sees alone (its own context and its own block,
bidirectionally), with RoPE at its own positions. Other drafters (sliding windows, DFlash2's
convolutions), or a drafter only one row uses, propose row by row as alone. The server's sink
window (``models/window.py``) is fine: its cache drops old context itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from dflash_server.models.context import ContextCache
from dflash_server.models.drafter import DFlashDecoderLayer, DFlashDraftModel
from dflash_server.models.window import SinkContextCache


@dataclass
class DraftRow:
    """What one row drafts from: ``drafter.propose``'s arguments."""

    drafter: Any  # the row's drafter (a test double may wrap the real one as ``inner``)
    block: mx.array  # [1, width]: [anchor, mask, ...]
    context: mx.array | None  # new committed positions' taps
    cache: list[Any]
    sampler: Any
    history: mx.array | None


def _base(drafter: Any) -> Any:
    return getattr(drafter, "inner", drafter)


def _batchable(row: DraftRow) -> bool:
    base = _base(row.drafter)
    if type(base) is not DFlashDraftModel or base.config.input_embedding_scale != 1.0:
        return False
    if base is not row.drafter and not hasattr(row.drafter, "planted"):
        return False  # a wrapper that changes logits in a way we cannot reproduce per row
    layers_ok = all(
        type(layer) is DFlashDecoderLayer
        and layer.self_attn.window is None
        and not layer.self_attn.causal
        for layer in base.layers
    )
    # Full context, or the server's sink window (which drops old entries itself: no mask).
    caches_ok = all(type(c) in (ContextCache, SinkContextCache) for c in row.cache)
    caches_ok = caches_ok and all(c.max_size is None for c in row.cache if type(c) is ContextCache)
    return layers_ok and caches_ok


def propose_rows(rows: list[DraftRow]) -> list[tuple[mx.array, mx.array | None]]:
    """(drafts, log q) per row, in order."""
    out: list[Any] = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if _batchable(row):
            groups.setdefault(id(_base(row.drafter)), []).append(i)
        else:
            out[i] = row.drafter.propose(
                row.block, row.context, row.cache, row.sampler, row.history
            )
    for members in groups.values():
        if len(members) == 1:
            row = rows[members[0]]
            out[members[0]] = row.drafter.propose(
                row.block, row.context, row.cache, row.sampler, row.history
            )
            continue
        for i, proposal in zip(members, _together([rows[i] for i in members])):
            out[i] = proposal
    return out


def _together(rows: list[DraftRow]) -> list[tuple[mx.array, mx.array | None]]:
    base: DFlashDraftModel = _base(rows[0].drafter)
    bound = base._bound_target()
    for row in rows:  # each row's new context joins its own cache first
        if row.context is not None and row.context.shape[1] > 0:
            base.append_context(row.context, row.cache)
    widths = [row.block.shape[1] for row in rows]
    width = max(widths)
    mask_id = base.config.mask_token_id
    blocks = [
        mx.concatenate([r.block[0], mx.full((width - w,), mask_id, r.block.dtype)])
        for r, w in zip(rows, widths)
    ]
    h = bound.embed_tokens(mx.stack(blocks))
    offsets = mx.array([row.cache[0].offset for row in rows])
    block_cols = mx.arange(width)[None] < mx.array(widths)[:, None]
    for layer_index, layer in enumerate(base.layers):
        contexts = [row.cache[layer_index].fetch() for row in rows]
        if any(ctx is None for ctx in contexts):
            raise RuntimeError("a drafting row has no context (its prefill fed none)")
        lengths = [ctx[0].shape[2] for ctx in contexts]
        longest = max(lengths)
        # [rows, 1, width, longest + width]: a row's own context, then its own block.
        ctx_cols = mx.arange(longest)[None] >= mx.array([longest - n for n in lengths])[:, None]
        visible = mx.concatenate([ctx_cols, block_cols], axis=1)[:, None, None, :]
        visible = mx.broadcast_to(visible, (len(rows), 1, width, longest + width))
        h = _layer(layer, h, contexts, lengths, longest, offsets, visible)
    logits = bound.logits(base.norm(h)[:, 1:])
    out = []
    for i, (row, w) in enumerate(zip(rows, widths)):
        row_logits = logits[i : i + 1, : w - 1]
        if row.drafter is not base:  # a test double plants its tokens over the real logits
            row_logits = row.drafter.planted(row.block, row.cache, 1, row_logits)
        out.append(row.sampler.propose(row_logits[0], row.history))
    return out


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
    layer: DFlashDecoderLayer,
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
