"""The DFlash drafter: a small block-diffusion model conditioned on the target's hidden states.

One forward pass proposes a whole block. The block attends to itself (bidirectionally unless the
config says ``is_causal``) and to the "context": features of the committed tokens, taken from the
target's tapped layers and injected as extra keys/values in every draft layer (DFlash paper, "KV
injection"); sliding-window layers see context within ``sliding_window`` of each query only.
Parameter names mirror the published checkpoints (z-lab/Qwen3.5-*-DFlash), which carry no
embedding and no lm_head: those are borrowed from the target with ``bind``. DFlash2 builds on
these modules (``dflash2.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from dflash_server.models.context import ContextCache
from dflash_server.models.draft_rows import DraftRow, block_logits_together
from dflash_server.models.fused import Norm, rope_at
from dflash_server.models.target_parts import find_target_parts
from dflash_server.models.variants import (
    OPTIONAL_DEFAULTS,
    check_pair,
    dflash_kwargs,
    target_logit_scale,
)
from dflash_server.models.window import SinkContextCache, apply_draft_window


class DraftSampler(Protocol):
    """What a drafter asks of the decoder's sampler (``generation.sampling.TokenSampler``)."""

    processors: list[Any]  # logits processors (penalties); empty when there are none

    @property
    def deterministic(self) -> bool:  # greedy or a black-box sampler: drafts carry no q
        ...

    def next_key(self) -> mx.array: ...
    def process(self, logits: mx.array, history: mx.array) -> mx.array: ...
    def logprobs(self, logits: mx.array) -> mx.array: ...
    def propose(
        self, draft_logits: mx.array, history: mx.array | None
    ) -> tuple[mx.array, mx.array | None]: ...


@dataclass
class DFlashConfig:
    """Drafter hyper-parameters; field names follow the reference ``dflash.model_mlx``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None  # None (some assistant exports): the target's, checked at bind
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    mask_token_id: int = 0
    rope_scaling: dict[str, Any] | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    sliding_window_size: int | None = None  # a context window for every layer (reference key)
    # None: the family's rule (DFlash: bidirectional block; DFlash2: causal on sliding layers).
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if not self.layer_types:
            self.layer_types = ("full_attention",) * self.num_hidden_layers
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"drafter config: layer_types has {len(self.layer_types)} entries but "
                f"num_hidden_layers is {self.num_hidden_layers}; they must match"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"drafter config: unsupported layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("drafter config: sliding_attention layers need 'sliding_window'")
        if self.block_size < 2:
            raise ValueError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ValueError(
                f"drafter config: sliding_window must be >= 2, not {self.sliding_window}"
            )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlashConfig:
        """Parse a drafter ``config.json`` (flat keys plus nested ``dflash_config``)."""
        return cls(**dflash_kwargs(cfg))

    def to_dict(self) -> dict[str, Any]:
        """The HF-style ``config.json`` this config was (or could have been) read from."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        dflash = {"target_layer_ids": list(out.pop("target_layer_ids"))}
        dflash["mask_token_id"] = out.pop("mask_token_id")
        out["layer_types"] = list(out["layer_types"])
        for name, default in OPTIONAL_DEFAULTS.items():  # published v1 configs omit these
            if out.get(name) == default:
                out.pop(name)
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **out,
            "dflash_config": dflash,
        }


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from the cached context plus the block.

    ``causal`` masks later block positions; a sliding ``window`` hides keys ``window`` or more
    positions away from a query (absolute positions). Neither set: no mask at all.
    """

    def __init__(self, config: DFlashConfig, layer_idx: int, causal: bool = False):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scale = hd**-0.5
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if sliding else None
        self.causal = causal
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = Norm(hd, eps=config.rms_norm_eps)
        self.k_norm = Norm(hd, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            hd, config.rope_theta, False, config.rope_scaling, config.max_position_embeddings
        )

    context_window: tuple[int, int] | None = None  # (window, sinks): see models/window.py

    def make_cache(self) -> ContextCache:
        if self.window is None and self.context_window is not None:
            return SinkContextCache(*self.context_window)
        return ContextCache(None if self.window is None else self.window - 1)

    def _keys_values(
        self, x: mx.array, offset: int | mx.array, compiled: bool = False
    ) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # Block-sized inputs take the compiled RoPE (few shapes); context appends vary in length.
        return (rope_at(self.rope, k, offset) if compiled else self.rope(k, offset=offset)), v

    def append_context(self, context: mx.array, cache: ContextCache) -> None:
        """Project committed positions once; only context K/V is ever cached."""
        cache.append(*self._keys_values(context, cache.offset))

    def _mask(self, L: int, S: int) -> mx.array | None:
        """[L, S + L] visibility, key index minus S = position relative to block start."""
        far = self.window is not None and self.window <= S + L - 1
        if not (self.causal or far):
            return None
        q = mx.arange(L)[:, None]
        k = mx.arange(S + L)[None] - S
        visible = mx.ones((L, S + L), dtype=mx.bool_)
        if far and self.window is not None:
            visible = (q - k < self.window) & (k - q < self.window)
        return visible & (k <= q) if self.causal else visible

    def __call__(self, x: mx.array, cache: ContextCache) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope_at(self.rope, q, cache.offset)
        keys, values = self._keys_values(x, cache.offset, compiled=True)
        context = cache.fetch()
        S = 0 if context is None else context[0].shape[2]
        if context is not None:
            keys = mx.concatenate([context[0], keys], axis=2)
            values = mx.concatenate([context[1], values], axis=2)
        mask = self._mask(L, S)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int, causal: bool = False):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx, causal)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = Norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Norm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, cache: ContextCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class _BoundTarget:
    """The target's embedding and head; a plain object so they never join the drafter's weights.

    Logits are ``head(h) * multiplier``, then ``cap * tanh(x / cap)`` when a softcap is set.
    """

    def __init__(self, embed_tokens: nn.Module, lm_head: Any, multiplier: float, cap: float | None):
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        self.multiplier, self.cap = multiplier, cap

    def logits(self, h: mx.array) -> mx.array:
        out = self.lm_head(h)
        if self.multiplier != 1.0:
            out = out * self.multiplier
        return out if self.cap is None else self.cap * mx.tanh(out / self.cap)


class DFlashDraftModel(nn.Module):
    layer_class: type[DFlashDecoderLayer] = DFlashDecoderLayer
    family = "DFlash"  # the checkpoint layout it came from; load_draft sets it (e.g. "assistant")

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Norm(H, eps=config.rms_norm_eps)
        self.layers = [
            self.layer_class(config, i, self.layer_is_causal(i))
            for i in range(config.num_hidden_layers)
        ]
        self.norm = Norm(H, eps=config.rms_norm_eps)
        self._bound: _BoundTarget | None = None

    def layer_is_causal(self, i: int) -> bool:
        """DFlash's block is bidirectional unless the config says ``is_causal: true``."""
        return bool(self.config.is_causal)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def bind(self, target: nn.Module) -> DFlashDraftModel:
        """Borrow the target's embedding and lm_head after checking that the pair fits.

        A config left at multiplier 1 without softcap takes the target's own logit scale (as the
        reference does for "assistant" heads), so draft and target logits share one scale.
        """
        parts = find_target_parts(target)
        check_pair(self.config, parts.hidden_size, parts.vocab_size, parts.num_layers)
        scale = (self.config.output_multiplier, self.config.final_logit_softcapping)
        if scale == (1.0, None):
            scale = target_logit_scale(target) or scale
        self._bound = _BoundTarget(parts.embed_tokens, parts.lm_head, *scale)
        return self

    def set_window(self, window: int | None) -> int | None:
        """Bound the full-attention layers' context (docs/design.md, "Drafter window")."""
        return apply_draft_window(self, window)

    def make_cache(self) -> list[ContextCache]:
        return [layer.self_attn.make_cache() for layer in self.layers]

    def append_context(
        self,
        target_hidden: mx.array,
        cache: list[ContextCache],
        tokens: mx.array | None = None,
    ) -> None:
        """Add committed positions' tapped features (``[B, S, L*H]``) to the context cache
        (DFlash reads the features only, not the ``tokens`` fed there)."""
        windows = [layer.self_attn.window for layer in self.layers]
        widest = None if None in windows else max(w for w in windows if w is not None)
        skipped = 0
        if widest is not None and target_hidden.shape[1] > widest - 1:
            # Every layer slides: positions older than the widest window are never seen again.
            skipped = target_hidden.shape[1] - (widest - 1)
            target_hidden = target_hidden[:, skipped:]
        context = self.hidden_norm(self.fc(target_hidden))
        for layer, c in zip(self.layers, cache):
            if skipped:
                c.skip(skipped)
            layer.self_attn.append_context(context, c)

    def context_window(self) -> tuple[int, int] | None:
        """(newest, sinks) positions its layers read: a sliding layer its trained window, a
        full one the server's sink window (``models/window.py``); None if any reads them all."""
        newest, sinks = 0, 0
        for layer in self.layers:
            attn = layer.self_attn
            if attn.window is not None:
                newest = max(newest, attn.window - 1)
            elif attn.context_window is not None:
                window, layer_sinks = attn.context_window
                newest, sinks = max(newest, window - layer_sinks), max(sinks, layer_sinks)
            else:
                return None
        return newest, sinks

    def skip_context(self, n: int, cache: list[ContextCache]) -> None:
        """Advance every layer's context past ``n`` positions no query will read."""
        for c in cache:
            c.skip(n)

    def _bound_target(self) -> _BoundTarget:
        if self._bound is None:
            raise RuntimeError(f"{type(self).__name__}.bind(target) must be called before drafting")
        return self._bound

    def hidden_states(
        self, block_ids: mx.array, target_hidden: mx.array | None, cache: list[ContextCache]
    ) -> mx.array:
        """Final-normed block states ``[1, B, H]``; new context taps are appended first."""
        bound = self._bound_target()
        if target_hidden is not None and target_hidden.shape[1] > 0:
            self.append_context(target_hidden, cache)
        h = bound.embed_tokens(block_ids)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)

    def __call__(
        self,
        block_ids: mx.array,
        target_hidden: mx.array | None,
        cache: list[ContextCache],
        logits_start: int = 0,
    ) -> mx.array:
        """Logits for a block; ``target_hidden`` holds the taps of positions new since last call.

        Row j >= 1 predicts the token at block position j (row 0 is the committed anchor).
        """
        h = self.hidden_states(block_ids, target_hidden, cache)
        return self._bound_target().logits(h[:, logits_start:])

    def propose(
        self,
        block_ids: mx.array,
        target_hidden: mx.array | None,
        cache: list[ContextCache],
        sampler: DraftSampler,
        history: mx.array | None,
    ) -> tuple[mx.array, mx.array | None]:
        """Drafts for block positions 1..B-1 and the log-probs ``log q`` they were drawn from
        (None when greedy): the contract the decoder relies on, whatever the drafter family."""
        logits = self(block_ids, target_hidden, cache, logits_start=1)[0]
        return sampler.propose(logits, history)

    def propose_rows(self, rows: Sequence[DraftRow]) -> list[tuple[mx.array, mx.array | None]]:
        """``propose`` for several rows of this drafter, in one pass where the layers allow
        it (``models/draft_rows.py``), else row by row."""
        if len(rows) < 2 or not self.drafts_together(rows):
            return [row.propose() for row in rows]
        logits = self.block_logits_together(rows)
        return [row.sampler.propose(x[0], row.history) for row, x in zip(rows, logits)]

    def drafts_together(self, rows: Sequence[DraftRow]) -> bool:
        """Whether these rows' blocks can share one pass: full-attention bidirectional layers
        over the whole context or the server's sink window (which drops old entries itself)."""
        if type(self) is not DFlashDraftModel or self.config.input_embedding_scale != 1.0:
            return False
        layers = all(
            type(layer) is DFlashDecoderLayer
            and layer.self_attn.window is None
            and not layer.self_attn.causal
            for layer in self.layers
        )
        caches = all(
            type(c) is SinkContextCache or (type(c) is ContextCache and c.max_size is None)
            for row in rows
            for c in row.cache
        )
        return layers and caches

    def block_logits_together(self, rows: Sequence[DraftRow]) -> list[mx.array]:
        """Each row's block logits ([1, width - 1, V]) from one pass (``drafts_together``)."""
        return block_logits_together(self, self._bound_target(), rows)
