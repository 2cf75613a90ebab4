"""How much cache memory a request holds: its target KV, recurrent state and drafter context.

``kv_geometry`` reads the sizes off a loaded pair once (no forward pass); ``kv_bytes`` is the
pure estimate the engine's KV budget admits requests by (docs/operations.md, "KV memory
budget"). Per request of ``tokens`` positions (prompt + max new tokens):

* each full-attention layer of the target: K and V, ``kv_heads x head_dim`` elements each per
  position, over ``tokens + widest verify block + 256`` columns (mlx-lm's ``KVCache`` and the
  batch's ``RaggedKVCache`` grow 256 columns at a time, and a verify writes its block first);
  quantized (``kv_bits``): ``bits / 8`` bytes per element plus a scale and a bias per group;
* each Gated DeltaNet layer: a fixed conv window and a float32 recurrent state per row;
* each drafter layer: its context K/V, bounded by its window when it has one (plus the 256
  columns a context buffer grows by, and the sink positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dflash_server.drafters.protocol import ContextLayer, Drafter
from dflash_server.models.target_parts import find_target_parts, float_bytes

STEP = 256  # columns a KV buffer grows by (mlx-lm's KVCache.step, RowLayout.step, ContextCache)


@dataclass(frozen=True)
class KVGeometry:
    """The cache sizes of a loaded pair, per request."""

    kv_elements: int  # K and V elements per position, summed over the full-attention layers
    dtype_bytes: int  # bytes per K/V element (unquantized)
    recurrent_bytes: int  # fixed per request: every Gated DeltaNet layer's conv and state
    draft: tuple[ContextLayer, ...] = ()
    block: int = 1  # widest verify block: positions a verify writes past the committed ones


def attention_bytes(
    g: KVGeometry, tokens: int, *, kv_bits: int | None = None, group_size: int | None = None
) -> int:
    """The target's K/V of one request holding ``tokens`` positions (buffer growth included)."""
    columns = tokens + g.block + STEP
    return columns * bytes_per_position(g, kv_bits=kv_bits, group_size=group_size)


def bytes_per_position(
    g: KVGeometry, *, kv_bits: int | None = None, group_size: int | None = None
) -> int:
    """K/V bytes one position adds over the full-attention layers: full precision, or
    ``kv_bits`` per element plus a scale and a bias (the cache's dtype) per group."""
    if kv_bits is None:
        return g.kv_elements * g.dtype_bytes
    groups = math.ceil(g.kv_elements / (group_size or 64))
    return math.ceil(g.kv_elements * kv_bits / 8) + groups * 2 * g.dtype_bytes


def draft_bytes(g: KVGeometry, tokens: int) -> int:
    """The drafter's context caches of one request holding ``tokens`` positions."""
    total = 0
    for layer in g.draft:
        kept = tokens if layer.bound is None else min(tokens, layer.bound)
        total += (kept + STEP + layer.sinks) * layer.bytes_per_token
    return total


def kv_bytes(
    g: KVGeometry, tokens: int, *, kv_bits: int | None = None, group_size: int | None = None
) -> int:
    """Everything one request's caches may hold at ``tokens`` positions: an upper bound."""
    kv = attention_bytes(g, tokens, kv_bits=kv_bits, group_size=group_size)
    return kv + g.recurrent_bytes + draft_bytes(g, tokens)


def kv_geometry(model: Any, draft: Drafter | None = None, block: int = 1) -> KVGeometry | None:
    """Read the cache sizes off an mlx-lm target (and what its drafter's context keeps); None
    when its layers are not the kind this knows (attention with ``k_proj``/``v_proj``, Gated
    DeltaNet)."""
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

    try:
        parts = find_target_parts(model)
        act = float_bytes(parts.embed_tokens)
        elements = recurrent = 0
        kv_dtype = act
        # mlx-lm's own choice of caches: a model without ``make_cache`` (qwen3, llama) gets
        # one KVCache per layer; calling the method directly sized no budget for those.
        for layer, cache in zip(parts.layers, make_prompt_cache(model), strict=True):
            if type(cache) is KVCache:
                attn = layer.self_attn
                elements += attn.k_proj.weight.shape[0] + attn.v_proj.weight.shape[0]
                kv_dtype = max(kv_dtype, float_bytes(attn.k_proj))
            elif type(cache) is ArraysCache:
                gdn = layer.linear_attn
                conv = (gdn.conv_kernel_size - 1) * gdn.conv_dim * act
                state = gdn.num_v_heads * gdn.head_v_dim * gdn.head_k_dim * 4  # float32
                recurrent += conv + state
            else:
                return None
        layers = draft.context_layers(act) if draft is not None else ()
    except (AttributeError, ValueError, TypeError):
        return None
    return KVGeometry(elements, kv_dtype, recurrent, layers, max(1, block))
