"""EAGLE-3 drafters (Li et al., 2025), loaded unmodified from RedHat's speculators exports
(``Eagle3Speculator``) and SpecForge / EAGLE-repository checkpoints (``LlamaForCausalLMEagle3``).

A Llama decoder layer (rarely more) reading three of the target's hidden states. At committed
position i it pairs the target's taps t_i with the token after it, x_{i+1}::

    g_i = fc(t_i)                           (3H -> H; EAGLE 3.1 norms each tap first: fc_norm)
    o_i = layer(norm_e(embed(x_{i+1})), g_i)     attention reads [norm_e(e) ; hidden_norm(g)]
    q(x_{i+2}) = softmax(lm_head(norm(o_i)))     a draft vocabulary: target id = d + d2t[d]

It drafts k tokens one after another, as the MTP head does (``mtp.py``): the first from
(g_{n-1}, the anchor x_n), each next one from its own output o (before the final norm) and the
draft just proposed; several rows together, one pass per step (``stepwise.py``). Its context is
the layer's K/V over committed positions plus the newest position's g; what drafting adds is
dropped, so it never rolls back. q is scattered into the target's vocabulary (-inf elsewhere),
so sampled acceptance is exact. The embedding is its own when the checkpoint has one, else the
target's (docs/design.md, "Drafter families").

Taps: an EAGLE aux layer id names a layer's *input* (the output of the layer before it) where our
taps name outputs, so tap = aux - 1 (speculators / vLLM; default aux (2, L/2, L-3)). SpecForge's
``eagle_config.eagle_aux_hidden_state_layer_ids`` name outputs already (SGLang adds the 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.rope_utils import initialize_rope

from dflash_server.drafters.dflash import MLP
from dflash_server.drafters.eagle3_config import FIT, Eagle3Config, default_taps
from dflash_server.drafters.protocol import ContextLayer, Drafted, DraftRow, Family
from dflash_server.drafters.stepwise import (
    Walk,
    batch_of,
    kv_context_layers,
    row_cache,
)
from dflash_server.models.loading import load_arrays, load_checkpoint
from dflash_server.models.target_parts import find_target_parts

__all__ = ["FAMILY", "Eagle3Config", "Eagle3Drafter", "default_taps"]


class Attention(nn.Module):
    """Grouped-query attention over the context's K/V, reading ``width`` features (2H on the
    first layer: the token's embedding beside the hidden state)."""

    def __init__(self, c: Eagle3Config, width: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(width, self.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(width, self.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(width, self.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
            self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.rope = initialize_rope(
            c.head_dim, c.rope_theta, False, c.rope_scaling, c.max_position_embeddings
        )

    def _heads(self, x: mx.array, proj: nn.Module, n: int, norm: Any = None) -> mx.array:
        B, L, _ = x.shape
        h = proj(x).reshape(B, L, n, -1)
        return (h if norm is None else norm(h)).transpose(0, 2, 1, 3)

    def remember(self, x: mx.array, cache: Any) -> tuple[mx.array, mx.array]:
        """Append the K/V of ``x``'s positions to ``cache``; return all of its K/V."""
        keys = self._heads(x, self.k_proj, self.n_kv_heads, self.get("k_norm"))
        keys = self.rope(keys, offset=cache.offset)
        values = self._heads(x, self.v_proj, self.n_kv_heads)
        return cache.update_and_fetch(keys, values)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        queries = self._heads(x, self.q_proj, self.n_heads, self.get("q_norm"))
        queries = self.rope(queries, offset=cache.offset)  # before remember moves the offset
        keys, values = self.remember(x, cache)
        out = scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.scale, mask=mask
        )
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    """A Llama decoder layer; the first one's attention reads [input_layernorm(embedding) ;
    hidden_norm(g)], its residual g (or hidden_norm(g) with ``norm_before_residual``)."""

    def __init__(self, c: Eagle3Config, first: bool):
        super().__init__()
        self.first, self.norm_before_residual = first, c.norm_before_residual
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if first:
            self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Attention(c, (2 if first else 1) * c.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def inputs(self, x: mx.array, emb: mx.array | None) -> tuple[mx.array, mx.array]:
        """(the attention's input, the residual) for hidden states ``x``."""
        if not self.first:
            return self.input_layernorm(x), x
        h = self.hidden_norm(x)
        joined = mx.concatenate([self.input_layernorm(emb), h], axis=-1)
        return joined, h if self.norm_before_residual else x

    def __call__(self, x: mx.array, emb: mx.array | None, mask: Any, cache: Any) -> mx.array:
        attn_in, residual = self.inputs(x, emb)
        x = residual + self.self_attn(attn_in, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 head (``FAMILY``); parameter names follow the speculators layout."""

    family = "EAGLE-3"
    window = None  # its layers read the whole context: no window to bound

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = c = config
        width = c.num_taps * (c.target_hidden_size or c.hidden_size)
        if c.own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if c.norm_before_fc:
            self.input_norm = nn.RMSNorm(width, eps=c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = [
                nn.RMSNorm(width // c.num_taps, eps=c.rms_norm_eps) for _ in range(c.num_taps)
            ]
        self.fc = nn.Linear(width, c.hidden_size, bias=False)
        self.layers = [DecoderLayer(c, i == 0) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self._hot: mx.array | None = None  # each draft id's target id (None: the same vocab)
        self._target: tuple[Any] | None = None  # (the embedding,), set by bind

    def set_vocabulary(self, d2t: mx.array | None) -> None:
        """Map the draft vocabulary into the target's (``d2t``: target id - draft id)."""
        c = self.config
        if d2t is None and c.draft_vocab_size != c.vocab_size:
            raise ValueError(
                f"EAGLE-3 checkpoint: a {c.draft_vocab_size}-token draft vocabulary but no d2t "
                f"tensor mapping it into the target's {c.vocab_size}: copy the trainer's d2t in"
            )
        if d2t is not None and tuple(d2t.shape) != (c.draft_vocab_size,):
            raise ValueError(
                f"EAGLE-3 checkpoint: d2t has shape {tuple(d2t.shape)}, not "
                f"({c.draft_vocab_size},) (draft_vocab_size): is it from the same export?"
            )
        self._hot = None
        if d2t is not None and (c.draft_vocab_size != c.vocab_size or d2t.any().item()):
            self._hot = mx.arange(c.draft_vocab_size) + d2t.astype(mx.int32)
            if (self._hot >= c.vocab_size).any().item():
                raise ValueError(f"EAGLE-3 checkpoint: d2t maps past the {c.vocab_size} tokens")

    def bind(self, target: nn.Module) -> Eagle3Drafter:
        """Check the pair fits (hidden width, vocabulary, taps) and borrow the target's
        embedding when the checkpoint has none; a ValueError names what differs."""
        parts, c = find_target_parts(target), self.config
        width = c.target_hidden_size or c.hidden_size
        problems = []
        if parts.hidden_size != width:
            problems.append(
                f"it reads {width}-wide hidden states (fc.weight: {c.num_taps} x {width}), the "
                f"target's are {parts.hidden_size} wide"
            )
        if parts.vocab_size != c.vocab_size:
            problems.append(f"vocab_size {c.vocab_size} != the target's {parts.vocab_size}")
        if not c.own_embedding and parts.hidden_size != c.hidden_size:
            problems.append(
                f"it has no embed_tokens of its own and the target's embedding is "
                f"{parts.hidden_size} wide, not {c.hidden_size}"
            )
        taps = c.taps if c.taps is not None else default_taps(parts.num_layers)
        if bad := [t for t in taps if not 0 <= t < parts.num_layers]:
            problems.append(
                f"its taps {bad} (layer outputs; -1: the embedding) are not among the target's "
                f"{parts.num_layers} layers"
            )
        if problems:
            raise ValueError(
                f"EAGLE-3 drafter does not fit this target: {'; '.join(problems)}: {FIT}"
            )
        c.depth = parts.num_layers
        self._target = (self.embed_tokens if c.own_embedding else parts.embed_tokens,)
        return self

    def set_window(self, window: int | None) -> int | None:
        return None  # its layers read the whole context: no window to bound

    def context_window(self) -> tuple[int, int] | None:
        return None  # it reads every committed position

    def skip_context(self, n: int, cache: list[Any]) -> None:
        raise ValueError("the EAGLE-3 head reads every position: no context can be skipped")

    def context_layers(self, activation_bytes: int) -> tuple[ContextLayer, ...]:
        """Each layer's K/V over every committed position (the pending g is one position)."""
        return kv_context_layers(self.layers, activation_bytes)

    def make_cache(self) -> list[Any]:
        return row_cache(len(self.layers))

    def append_context(self, taps: mx.array, cache: list[Any], tokens: mx.array) -> None:
        """Pair each new committed position's g with the token after it (the newest waits in
        ``PendingHidden`` for the next call or the anchor); only the K/V is kept."""
        g, pending = self.project(taps), cache[-1]
        if pending.hidden is not None:  # its next token is the first one fed here
            g, nxt = mx.concatenate([pending.hidden, g], axis=1), tokens
        else:  # the prompt's first position: nothing before it
            nxt = tokens[1:]
        if n := nxt.shape[0]:
            emb, x = self.embed(nxt[None]), g[:, :n]
            mask = create_attention_mask(x, cache[0])
            *body, last = self.layers
            for i, layer in enumerate(body):
                x = layer(x, emb if i == 0 else None, mask, cache[i])
            # The last layer's output is never read for committed positions: its K/V only.
            last.self_attn.remember(last.inputs(x, emb if not body else None)[0], cache[len(body)])
        pending.hidden = g[:, -1:]
        pending.offset += taps.shape[1]

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """Each row's ``width - 1`` drafts after its anchor (``block[0, 0]``) and their log q
        over the target's vocabulary (None when greedy): one pass per draft step for all rows,
        their K/V read as one padded batch (``stepwise.py``); a lone row reads its own cache."""
        if any(row.cache[-1].hidden is None for row in rows):
            raise RuntimeError("the EAGLE-3 head has no context (its prefill fed none)")
        walk, c = Walk(rows), self.config
        if walk.steps == 0:
            return walk.drafted()
        if len(rows) == 1:
            layers = rows[0].cache[:-1]
        else:
            layers = [batch_of([row.cache[i] for row in rows]) for i in range(len(self.layers))]
        hidden = mx.concatenate([row.cache[-1].hidden for row in rows])
        for _ in range(walk.steps):  # each pass adds K/V that is dropped below
            emb = self.embed(walk.last[:, None])
            mask = create_attention_mask(hidden, layers[0])
            for i, (layer, cache) in enumerate(zip(self.layers, layers)):
                hidden = layer(hidden, emb if i == 0 else None, mask, cache)
            normed = self.norm(hidden)
            walk.draw(self._logits(normed if c.norm_logits else hidden)[:, 0])
            hidden = normed if c.feed_normed else hidden
        if len(rows) == 1:
            for cache in layers:
                cache.trim(walk.steps)
        return walk.drafted()

    def project(self, taps: mx.array) -> mx.array:
        """g: the joined taps ([1, T, n*H]) projected to the head's width by ``fc``."""
        if self.config.norm_before_fc:
            taps = self.input_norm(taps)
        if self.config.fc_norm:
            chunks = mx.split(taps, len(self.fc_norm), axis=-1)
            taps = mx.concatenate([n(x) for n, x in zip(self.fc_norm, chunks)], axis=-1)
        return self.fc(taps)

    @property
    def target_ids(self) -> mx.array | None:
        """Each draft id's target id (None: the draft vocabulary is the target's)."""
        return self._hot

    def _logits(self, hidden: mx.array) -> mx.array:
        """Logits over the target's vocabulary: the draft vocabulary's at their target ids,
        -inf elsewhere (so a sampler's q is the head's own law)."""
        logits = self.lm_head(hidden)
        if self._hot is None:
            return logits
        full = mx.full((*logits.shape[:-1], self.config.vocab_size), -mx.inf, logits.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self._hot, logits.shape), logits, axis=-1)

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's embeddings of ``tokens`` (the head shares them)."""
        if self._target is None:
            raise RuntimeError("Eagle3Drafter.bind(target) must be called before use")
        return self._target[0](tokens)


# -- loading: either layout, unmodified ------------------------------------------------------


def _weights(path: Path) -> dict[str, mx.array]:
    """The folder's tensors named as the head names them (``midlayer.``: ``layers.0.``), the
    trainers' extras (``t2d``, the verifier's copies, rotary buffers) left out."""
    out: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        for key, value in load_arrays(f).items():
            key = key.removeprefix("model.").replace("midlayer.", "layers.0.", 1)
            if key != "t2d" and not key.startswith("verifier_") and "rotary_emb" not in key:
                out[key] = value
    if not out:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return out


def _load(path: Path, raw: dict[str, Any], target: nn.Module | None) -> Eagle3Drafter:
    weights = _weights(path)
    d2t = weights.pop("d2t", None)
    model = Eagle3Drafter(Eagle3Config.from_dict(raw, list(weights)))
    load_checkpoint(model, path, raw, source=f"{path} (EAGLE-3)", weights=weights)
    model.set_vocabulary(d2t)
    return model if target is None else model.bind(target)


def _claims(raw: dict[str, Any]) -> bool:
    """speculators' ``speculators_model_type: "eagle3"``, SpecForge's ``*ForCausalLMEagle3``,
    or the EAGLE repository's ``draft_vocab_size`` key (its trainer names no architecture)."""
    architecture = str((raw.get("architectures") or [""])[0])
    return (
        raw.get("speculators_model_type") == "eagle3"
        or architecture in ("Eagle3Speculator", "LlamaForCausalLMEagle3")
        or "draft_vocab_size" in raw
    )


FAMILY = Family(
    "EAGLE-3",
    _claims,
    _load,
    "Eagle3Speculator (speculators) or LlamaForCausalLMEagle3 (SpecForge, EAGLE)",
)
