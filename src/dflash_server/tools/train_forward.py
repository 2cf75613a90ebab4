"""The drafter's training forward: many anchors per sequence in one pass, equal to inference.

At inference a block ``[anchor, mask x (B-1)]`` at absolute positions ``a .. a+B-1`` attends to the
context (tapped target features of positions ``0 .. a-1``) and to itself, with no mask. Training
packs K such blocks per sequence: the context K/V of the whole sequence is projected once, and an
attention mask restricts block k to context keys ``< a_k`` plus its own B keys. Every projection,
norm and RoPE is the drafter's own submodule, so the numbers are those of ``draft(block, ...)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from dflash_server.drafters.dflash import DFlashAttention, DFlashDraftModel


@dataclass
class TrainBatch:
    """One step's inputs: ``tokens``/``labels`` ``[N, T]``, ``taps`` ``[N, T, L*H]``, anchors ``[N, K]``.

    ``labels[:, p]`` is the token the drafter should propose at position p: the data token, or the
    target's greedy prediction from the prefix ``0 .. p-1``. ``final`` ``[N, T, H]``: the target's
    final hidden states, for the families whose loss reads target probabilities (else None).
    """

    tokens: mx.array
    labels: mx.array
    taps: mx.array
    anchors: mx.array
    final: mx.array | None = None


def gather_positions(x: mx.array, idx: mx.array) -> mx.array:
    """``x[n, idx[n, ...]]``: rows of ``x`` ``[N, T, ...]`` at positions ``idx`` ``[N, ...]``."""
    N = idx.shape[0]
    flat = idx.reshape(N, -1)
    tail = x.shape[2:]
    picked = mx.take_along_axis(x, flat.reshape(N, -1, *([1] * len(tail))), axis=1)
    return picked.reshape(*idx.shape, *tail)


def sample_anchors(rng_uniform: mx.array, seq_len: int, block_size: int) -> mx.array:
    """Map uniforms in [0, 1) ``[N, K]`` to anchors in ``[1, T-B]`` (context >= 1, labels in range)."""
    high = seq_len - block_size  # anchor + B - 1 <= T - 1
    if high < 1:
        raise ValueError(f"sequence length {seq_len} is too short for block size {block_size}")
    return (1 + mx.floor(rng_uniform * high)).astype(mx.int32)


def block_attention_mask(
    anchors: mx.array, seq_len: int, block_size: int, window: int | None, causal: bool = False
) -> mx.array:
    """Boolean ``[N, 1, K*B, T + K*B]``: block k sees context ``< a_k`` and its own B keys.

    As at inference, a sliding window hides keys ``window`` or more positions from the query
    (row j of block k sits at ``a_k + j``), and a causal layer hides later block positions.
    """
    N, K = anchors.shape
    rows_anchor = mx.repeat(anchors, block_size, axis=1)[:, :, None]  # [N, K*B, 1]
    j = mx.tile(mx.arange(block_size), K)  # row offset inside its block
    ctx_pos = mx.arange(seq_len)[None, None, :]
    ctx_ok = ctx_pos < rows_anchor
    if window is not None:
        ctx_ok = ctx_ok & (rows_anchor + j[None, :, None] - ctx_pos < window)
    block_id = mx.arange(K * block_size) // block_size
    own = block_id[:, None] == block_id[None, :]
    gap = j[:, None] - j[None, :]  # query row minus key row, same block
    if window is not None:
        own = own & (mx.abs(gap) < window)
    if causal:
        own = own & (gap >= 0)
    own = mx.broadcast_to(own, (N, K * block_size, K * block_size))
    return mx.concatenate([ctx_ok, own], axis=-1)[:, None]


def _per_block(x: mx.array, K: int) -> mx.array:
    """``[N, K*B, ...]`` -> ``[N*K, B, ...]``: one row per block so RoPE gets per-block offsets."""
    N, KB = x.shape[:2]
    return x.reshape(N * K, KB // K, *x.shape[2:])


def _heads_back(x: mx.array, N: int, K: int) -> mx.array:
    """``[N*K, h, B, d]`` -> ``[N, h, K*B, d]``."""
    _, h, B, d = x.shape
    return x.reshape(N, K, h, B, d).transpose(0, 2, 1, 3, 4).reshape(N, h, K * B, d)


def _attention(
    attn: DFlashAttention, x: mx.array, context: mx.array, anchors: mx.array, mask: mx.array
) -> mx.array:
    N, KB, _ = x.shape
    K = anchors.shape[1]
    offsets = anchors.reshape(-1)
    xb = _per_block(x, K)
    q = attn.q_norm(attn.q_proj(xb).reshape(N * K, KB // K, attn.n_heads, -1))
    q = _heads_back(attn.rope(q.transpose(0, 2, 1, 3), offset=offsets), N, K)
    # Same helper inference uses: context at positions 0..T-1, each block at a_k .. a_k+B-1.
    k_ctx, v_ctx = attn.keys_values(context, 0)
    k_blk, v_blk = attn.keys_values(xb, offsets)
    keys = mx.concatenate([k_ctx, _heads_back(k_blk, N, K)], axis=2)
    values = mx.concatenate([v_ctx, _heads_back(v_blk, N, K)], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(N, KB, -1))


def draft_hidden(
    draft: DFlashDraftModel, block_embeds: mx.array, taps: mx.array, anchors: mx.array
) -> mx.array:
    """Final-normed drafter states ``[N, K, B, H]`` for K blocks per sequence, all in one pass."""
    N, T = taps.shape[:2]
    K = anchors.shape[1]
    B = block_embeds.shape[1] // K
    context = draft.hidden_norm(draft.fc(taps))
    masks: dict[tuple[int | None, bool], mx.array] = {}
    h = block_embeds
    for layer in draft.layers:
        attn = layer.self_attn
        kind = (attn.window, attn.causal)
        if kind not in masks:
            masks[kind] = block_attention_mask(anchors, T, B, *kind)
        h = h + _attention(attn, layer.input_layernorm(h), context, anchors, masks[kind])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h).reshape(N, K, B, -1)


def block_ids(tokens: mx.array, anchors: mx.array, block_size: int, mask_id: int) -> mx.array:
    """``[N, K*B]``: each block is ``[tokens[a_k], mask, ..., mask]``."""
    N, K = anchors.shape
    first = mx.take_along_axis(tokens, anchors, axis=1)[:, :, None]
    masks = mx.full((N, K, block_size - 1), mask_id, dtype=tokens.dtype)
    return mx.concatenate([first, masks], axis=2).reshape(N, K * block_size)


def block_labels(labels: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """``[N, K, B-1]``: the labels at positions ``a_k + 1 .. a_k + B - 1``."""
    idx = anchors[:, :, None] + mx.arange(1, block_size)[None, None, :]
    N, K, _ = idx.shape
    return mx.take_along_axis(labels, idx.reshape(N, -1), axis=1).reshape(N, K, block_size - 1)


def block_embeddings(draft: DFlashDraftModel, ids: mx.array) -> mx.array:
    """The blocks' input embeddings, scaled as ``DFlashDraftModel._forward`` scales them."""
    h = draft.target_head().embed_tokens(ids)  # bind the drafter to its target before training
    scale = draft.config.input_embedding_scale
    return h if scale == 1.0 else h * scale


def draft_logits(draft: DFlashDraftModel, tokens: mx.array, taps: mx.array, anchors: mx.array):
    """Logits ``[N, K, B-1, V]`` of block rows 1..B-1 (row 0, the anchor, predicts nothing)."""
    B = draft.config.block_size
    ids = block_ids(tokens, anchors, B, draft.config.mask_token_id)
    h = draft_hidden(draft, block_embeddings(draft, ids), taps, anchors)
    return draft.target_head().logits(h[:, :, 1:])


def position_weights(block_size: int, gamma: float | None) -> mx.array:
    """Loss weight of draft j (block row j+1): ``exp(-j/gamma)``; acceptance stops at the first
    miss, so early drafts matter most (gamma 7 for block 16 in published recipes; None = uniform)."""
    j = mx.arange(block_size - 1, dtype=mx.float32)
    return mx.ones_like(j) if gamma is None else mx.exp(-j / gamma)


def default_gamma(block_size: int) -> float:
    return 7.0 if block_size >= 16 else max(1.0, block_size / 2)


def loss_and_metrics(
    draft: DFlashDraftModel, batch: TrainBatch, weights: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """Weighted cross-entropy, plus top-1 accuracy and the expected accepted drafts per block.

    The last is the mean length of the correct prefix of each block: tau - 1 under greedy
    decoding if the contexts were the target's own text.
    """
    logits = draft_logits(draft, batch.tokens, batch.taps, batch.anchors).astype(mx.float32)
    labels = block_labels(batch.labels, batch.anchors, draft.config.block_size)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # [N, K, B-1]
    loss = (ce * weights).sum() / (weights.sum() * math.prod(ce.shape[:2]))
    correct = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
    accepted = mx.cumprod(correct, axis=-1).sum(axis=-1).mean()
    return loss, mx.stop_gradient(correct.mean()), mx.stop_gradient(accepted)
