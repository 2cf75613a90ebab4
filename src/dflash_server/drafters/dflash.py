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
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from dflash_server.drafters.config import (
    DFlashConfig,
    assistant_kwargs,
    check_pair,
    target_logit_scale,
)
from dflash_server.drafters.context import ContextCache, RowContexts
from dflash_server.drafters.protocol import ContextLayer, Drafted, DraftRow, Family
from dflash_server.drafters.window import SINKS, SinkWindow
from dflash_server.models.fused import Norm, rope_at
from dflash_server.models.loading import load_checkpoint
from dflash_server.models.target_parts import find_target_parts, float_bytes

# A layer's context: one row's cache, or several rows' read together for one pass.
Context = ContextCache | RowContexts


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

    def make_cache(self, window: SinkWindow | None) -> ContextCache:
        """A sliding layer keeps its trained window; a full one the server's, if any."""
        if self.window is not None:
            return ContextCache(self.window - 1)
        return ContextCache() if window is None else window.cache()

    def keys_values(
        self, x: mx.array, offset: int | mx.array, compiled: bool = False
    ) -> tuple[mx.array, mx.array]:
        """RoPE'd keys and values of positions ``offset ..`` (also what training projects)."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # Block-sized inputs take the compiled RoPE (few shapes); context appends vary in length.
        return (rope_at(self.rope, k, offset) if compiled else self.rope(k, offset=offset)), v

    def append_context(self, context: mx.array, cache: ContextCache) -> None:
        """Project committed positions once; only context K/V is ever cached."""
        cache.append(*self.keys_values(context, cache.offset))

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

    def __call__(self, x: mx.array, context: Context) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope_at(self.rope, q, context.offset)
        keys, values = self.keys_values(x, context.offset, compiled=True)
        held = context.fetch()
        S = 0 if held is None else held[0].shape[2]
        if held is not None:
            keys = mx.concatenate([held[0], keys], axis=2)
            values = mx.concatenate([held[1], values], axis=2)
        mask = context.visible(self._mask(L, S), L)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int, causal: bool = False):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx, causal)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = Norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Norm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, context: Context) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetHead:
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
    """A DFlash drafter (``family``: the checkpoint layout it came from, e.g. "assistant")."""

    layer_class: type[DFlashDecoderLayer] = DFlashDecoderLayer

    def __init__(self, config: DFlashConfig, family: str = "DFlash"):
        super().__init__()
        self.config = config
        self.family = family
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Norm(H, eps=config.rms_norm_eps)
        self.layers = [
            self.layer_class(config, i, self.layer_is_causal(i))
            for i in range(config.num_hidden_layers)
        ]
        self.norm = Norm(H, eps=config.rms_norm_eps)
        self.head: TargetHead | None = None  # the target's embedding and head (``bind``)
        # The bound on the full-attention layers' context: the config's (the reference's
        # ``sliding_window_size``) until ``set_window`` gives the server's.
        self.sink_window = SinkWindow.of(config.sliding_window_size)

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
        self.head = TargetHead(parts.embed_tokens, parts.lm_head, *scale)
        return self

    # -- the context ------------------------------------------------------------------------

    @property
    def window(self) -> int | None:
        return None if self.sink_window is None else self.sink_window.size

    def set_window(self, window: int | None, sinks: int = SINKS) -> int | None:
        """Bound the full-attention layers' context (docs/design.md, "Drafter window"): the
        first ``sinks`` positions and the newest; sliding layers keep their trained window."""
        self.sink_window = SinkWindow(window, sinks) if window else None
        return self.window

    def make_cache(self) -> list[ContextCache]:
        return [layer.self_attn.make_cache(self.sink_window) for layer in self.layers]

    def append_context(
        self, target_hidden: mx.array, cache: list[ContextCache], tokens: mx.array | None = None
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
        full one the server's sink window; None if any reads them all."""
        newest, sinks = 0, 0
        for layer in self.layers:
            window = layer.self_attn.window
            if window is not None:
                newest = max(newest, window - 1)
            elif self.sink_window is not None:
                size, own_sinks = self.sink_window.size, self.sink_window.sinks
                newest, sinks = max(newest, size - own_sinks), max(sinks, own_sinks)
            else:
                return None
        return newest, sinks

    def skip_context(self, n: int, cache: list[ContextCache]) -> None:
        """Advance every layer's context past ``n`` positions no query will read."""
        for c in cache:
            c.skip(n)

    def context_layers(self, activation_bytes: int) -> tuple[ContextLayer, ...]:
        """Each layer's context K/V per position, and the positions its cache keeps."""
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            width = attn.k_proj.weight.shape[0] + attn.v_proj.weight.shape[0]
            per_token = width * max(activation_bytes, float_bytes(attn.k_proj))
            if attn.window is not None:  # a sliding layer keeps window - 1 positions
                out.append(ContextLayer(per_token, attn.window - 1))
            elif self.sink_window is not None:  # sinks + the newest window - sinks
                size, sinks = self.sink_window.size, self.sink_window.sinks
                out.append(ContextLayer(per_token, size - sinks, sinks))
            else:
                out.append(ContextLayer(per_token, None))
        return tuple(out)

    # -- drafting -----------------------------------------------------------------------------

    def target_head(self) -> TargetHead:
        """The target's embedding and head (``bind`` sets them)."""
        if self.head is None:
            raise RuntimeError(f"{type(self).__name__}.bind(target) must be called before drafting")
        return self.head

    def _forward(self, block_ids: mx.array, contexts: Sequence[Context]) -> mx.array:
        """Final-normed block states over each layer's context."""
        h = self.target_head().embed_tokens(block_ids)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        for layer, context in zip(self.layers, contexts):
            h = layer(h, context)
        return self.norm(h)

    def hidden_states(
        self, block_ids: mx.array, target_hidden: mx.array | None, cache: list[ContextCache]
    ) -> mx.array:
        """Final-normed block states ``[1, B, H]``; new context taps are appended first."""
        if target_hidden is not None and target_hidden.shape[1] > 0:
            self.append_context(target_hidden, cache)
        return self._forward(block_ids, cache)

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
        return self.target_head().logits(h[:, logits_start:])

    def block_states(self, rows: Sequence[DraftRow]) -> mx.array:
        """Final-normed states ``[rows, widest, H]`` of every row's block, in one pass: each row's
        context left-padded and its block right-padded, the padding hidden from it, so a row's
        states are the ones it has alone (``RowContexts``)."""
        if len(rows) == 1:
            return self._forward(rows[0].block, rows[0].cache)
        widths = [row.width for row in rows]
        width, mask_id = max(widths), self.config.mask_token_id
        blocks = mx.stack([
            mx.concatenate([r.block[0], mx.full((width - r.width,), mask_id, r.block.dtype)])
            for r in rows
        ])  # fmt: skip
        contexts = [
            RowContexts([row.cache[i] for row in rows], widths) for i in range(len(self.layers))
        ]
        return self._forward(blocks, contexts)

    def block_logits(self, rows: Sequence[DraftRow]) -> list[mx.array]:
        """Each row's logits for its block positions 1.. ([1, width - 1, V]), one pass."""
        logits = self.target_head().logits(self.block_states(rows)[:, 1:])
        return [logits[i : i + 1, : row.width - 1] for i, row in enumerate(rows)]

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """Every row's drafts and the ``log q`` they were drawn from (None when greedy)."""
        logits = self.block_logits(rows)
        return [row.sampler.propose(x[0], row.history) for row, x in zip(rows, logits)]


# -- loading --------------------------------------------------------------------------------


def remap_assistant(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """``encoder.fc.*`` -> ``fc.*``, ``encoder.output_norm_enc.*`` -> ``hidden_norm.*``."""
    prefixes = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
    out = {}
    for k, v in weights.items():
        for old, new in prefixes.items():
            if k.startswith(old):
                k = new + k[len(old) :]
                break
        out[k] = v
    return out


def _load(path: Path, raw: dict[str, Any], target: nn.Module | None) -> DFlashDraftModel:
    model = DFlashDraftModel(DFlashConfig.from_dict(raw))
    load_checkpoint(model, path, raw, source=f"{path} (DFlash layout)")
    return model if target is None else model.bind(target)


def load_assistant(path: Path, raw: dict[str, Any], target: nn.Module | None) -> DFlashDraftModel:
    model = DFlashDraftModel(DFlashConfig(**assistant_kwargs(raw)), family="assistant")
    load_checkpoint(model, path, raw, remap_assistant, source=f"{path} (assistant layout)")
    return model if target is None else model.bind(target)


def _architecture(raw: dict[str, Any]) -> str:
    return str((raw.get("architectures") or [""])[0])


FAMILY = Family(
    "DFlash", lambda raw: _architecture(raw) == "DFlashDraftModel", _load, "DFlashDraftModel"
)
ASSISTANT = Family(
    "assistant",
    lambda raw: _architecture(raw).endswith("AssistantModel"),
    load_assistant,
    "*AssistantModel (DFlash weights under encoder.* names)",
)
