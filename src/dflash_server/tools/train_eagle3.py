"""``dflash-serve train --family eagle3``: an EAGLE-3 head with training-time test (TTT).

Position i pairs the target's taps t_i with the token after it, x_{i+1}, and predicts x_{i+2}.
Drafting then feeds the layer's own output and the draft it just made, k times; TTT trains that
unroll (speculators' ``Eagle3DraftModel.forward``, DeepSpec's ``compute_eagle3_loss``): step 0 is
one causal pass over the sequence, step j > 0 feeds every row its own step-(j-1) output and the
next label, at position i + j, attending to step 0's keys of positions <= i and to its own keys
of steps 1..j (a diagonal), which is exactly the context drafting sees. The layers run through
their inference code (``Eagle3Drafter``'s modules, a cache stand-in that stacks the steps' keys).
Loss per step: cross-entropy against the target's distribution over the draft vocabulary
(DeepSpec's soft CE; the data's one-hot with ``--labels data``), step j weighted ``exp(-j/gamma)``
(DeepSpec: 0.8^j). The embedding is the target's, frozen, saved as a copy (speculators' layout).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash_server.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_taps
from dflash_server.models.loading import flat_arrays
from dflash_server.models.target_parts import find_target_parts
from dflash_server.tools.train_forward import TrainBatch
from dflash_server.tools.train_init import default_taps as spread_taps
from dflash_server.tools.train_init import load_init, target_head_weights

LossFn = Callable[[Any, TrainBatch, mx.array], tuple[mx.array, mx.array, mx.array]]
DEFAULT_TTT = 7  # DeepSpec's ttt_length (speculators: 3)
GAMMA = -1.0 / float(np.log(0.8))  # DeepSpec's step_loss_decay 0.8 as exp(-j/gamma)


def eagle_taps(num_layers: int) -> list[int]:
    """EAGLE-3's aux layers (2, L/2, L-3) as layer outputs; shallow targets, where those
    collide or fall outside, get distinct layers spread over the depth instead."""
    taps = list(default_taps(num_layers))
    if len(set(taps)) < 3 or not all(0 <= t < num_layers for t in taps):
        taps = spread_taps(num_layers, 3)
    return taps


def init_eagle3(
    args: argparse.Namespace, model: nn.Module, tokenizer: Any, windows: np.ndarray
) -> tuple[Eagle3Drafter, dict[str, Any], str]:
    """(float32 head bound to ``model``, its speculators config, the dtype to save in): fresh
    (``--init new``: one layer shaped like the target's, speculators' defaults) or an EAGLE-3
    folder to fine-tune."""
    if args.init != "new":
        head, dtype = load_init(args, model, "EAGLE-3")
        if not head.config.norm_logits:
            raise ValueError(
                f"--init {args.init}: its lm_head reads the un-normed output (SpecForge's "
                "norm_output false), which speculators' layout cannot say; train a head that "
                "norms it"
            )
        if "embed_tokens" in head:  # speculators' copy of the target's: frozen
            head.embed_tokens.freeze()
        head.config.block_size = args.block_size or head.config.block_size
        return head, speculators_config(head, str(args.target)), dtype
    parts = find_target_parts(model)
    targs = getattr(getattr(model, "language_model", model), "args", None)
    H, V = parts.hidden_size, parts.vocab_size
    heads = int(getattr(targs, "num_attention_heads", 0) or max(1, H // 128))
    taps = [int(t) for t in args.taps.split(",")] if args.taps else eagle_taps(parts.num_layers)
    draft_vocab = V if args.draft_vocab is None else args.draft_vocab
    if not 1 <= draft_vocab <= V:
        raise ValueError(f"--draft-vocab {draft_vocab}: between 1 and the target's {V} tokens")
    config = Eagle3Config(
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(targs, "num_key_value_heads", 0) or heads),
        head_dim=int(getattr(targs, "head_dim", 0) or H // heads),
        intermediate_size=int(getattr(targs, "intermediate_size", 0) or 3 * H),
        vocab_size=V,
        draft_vocab_size=draft_vocab,
        rms_norm_eps=float(getattr(targs, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(targs, "rope_theta", 10000.0)),
        max_position_embeddings=int(getattr(targs, "max_position_embeddings", 4096)),
        num_hidden_layers=args.layers,
        taps=tuple(taps),
        num_taps=len(taps),
        norm_before_residual=True,  # speculators' defaults for EAGLE-3
        norm_before_fc=True,
        block_size=args.block_size,
    )
    head = Eagle3Drafter(config)
    # Start from the target's head (its rows of the draft vocabulary, as speculators does) and
    # its final-norm gain, so the first logits have the target's scale; both train.
    d2t = frequent_tokens(windows, draft_vocab, V) if draft_vocab < V else None
    head.set_vocabulary(d2t)
    lm_head = target_head_weights(model)[1]
    head.lm_head.weight = lm_head if head.target_ids is None else lm_head[head.target_ids]
    head.norm.weight = parts.backbone.norm.weight
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())
    head.train()
    head.bind(model)
    return head, speculators_config(head, str(args.target)), "float32"


def frequent_tokens(windows: np.ndarray, n: int, vocab: int) -> mx.array:
    """``d2t`` of a draft vocabulary of the ``n`` most frequent tokens in ``windows`` (ties and
    unseen tokens by id), sorted, as speculators' ``build_vocab_mappings_from_distribution``."""
    counts = np.bincount(windows.reshape(-1), minlength=vocab)[:vocab]
    hot = np.sort(np.argsort(-counts, kind="stable")[:n])
    return mx.array(hot - np.arange(n), dtype=mx.int64)


def speculators_config(head: Eagle3Drafter, target: str) -> dict[str, Any]:
    """The ``config.json`` speculators writes for ``head`` (``Eagle3Speculator``: the layer's
    keys in ``transformer_layer_config``, aux ids naming layer inputs); JSON types only."""
    c = head.config
    layer: dict[str, Any] = {
        "model_type": "qwen3" if c.qk_norm else "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    if c.rope_scaling:
        layer["rope_scaling"] = dict(c.rope_scaling)
    method = {"proposal_type": "greedy", "speculative_tokens": c.block_size - 1,
              "accept_tolerance": 0.0, "verifier_accept_k": 1}  # fmt: skip
    out: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in c.target_layer_ids],
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.feed_normed,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [method],
                               "verifier": {"name_or_path": target, "architectures": []}},
    }  # fmt: skip
    if c.target_hidden_size is not None:
        out["target_hidden_size"] = c.target_hidden_size
    return out


class Unrolled:
    """A layer's keys and values over the TTT steps, standing in for its inference cache:
    ``offset`` is the step (each row moves one position per step), each step's keys append."""

    def __init__(self) -> None:
        self.offset = 0
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        return self.keys, self.values


def ttt_logits(
    head: Eagle3Drafter, tokens: mx.array, labels: mx.array, taps: mx.array, steps: int
) -> list[mx.array]:
    """Each TTT step's logits ``[N, T-1, draft V]``: row i of step j drafts the token at
    ``i + 2 + j`` after committed positions ``0 .. i+1``, fed the labels at ``i + 2 .. i + j``
    as its earlier drafts (rows past the sequence end are padding, read by nothing valid)."""
    c = head.config
    R = tokens.shape[1] - 1
    x = head.project(taps[:, :R])
    caches = [Unrolled() for _ in head.layers]
    causal = mx.tril(mx.ones((R, R), dtype=mx.bool_))
    eye = mx.eye(R, dtype=mx.bool_)
    out = []
    for j in range(steps):
        ids = tokens[:, 1:] if j == 0 else mx.pad(labels[:, 1 + j :], [(0, 0), (0, j)])
        emb = head.embed(ids)
        mask = mx.concatenate([causal, *[eye] * j], axis=1)  # step 0's causal keys, then own
        h = x
        for i, (layer, cache) in enumerate(zip(head.layers, caches)):
            h = layer(h, emb if i == 0 else None, mask, cache)
        normed = head.norm(h)
        out.append(head.lm_head(normed if c.norm_logits else h))
        x = normed if c.feed_normed else h
        for cache in caches:
            cache.offset += 1
    return out


def make_eagle3_loss(args: argparse.Namespace, model: nn.Module) -> LossFn:
    """TTT's weighted per-step CE, with step 0's top-1 accuracy and the expected accepted drafts
    per cycle (greedy: the correct prefix over the steps) as metrics."""
    lm_head = find_target_parts(model).lm_head
    soft = args.labels == "target"

    def loss(
        head: Eagle3Drafter, batch: TrainBatch, weights: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        steps = weights.shape[0]
        T = batch.tokens.shape[1]
        c, hot = head.config, head.target_ids  # draft id -> target id (None: the same vocabulary)
        logits = ttt_logits(head, batch.tokens, batch.labels, batch.taps, steps)
        if soft:
            assert batch.final is not None, "EAGLE-3's loss reads the target's final states"
            target = lm_head(batch.final[:, 1 : T - 1]).astype(mx.float32)  # predicts 2 .. T-1
            target = target if hot is None else target[..., hot]
            p_all = mx.softmax(target, axis=-1)
        else:  # the data's tokens, one-hot in the draft vocabulary (others teach nothing)
            index = mx.full((c.vocab_size,), -1, mx.int32)
            if hot is not None:
                index[hot] = mx.arange(c.draft_vocab_size, dtype=mx.int32)
            ids = batch.labels[:, 2:] if hot is None else index[batch.labels[:, 2:]]
            p_all = (ids[..., None] == mx.arange(c.draft_vocab_size)).astype(mx.float32)
        total, correct = mx.array(0.0), []
        shortest = T - 1 - steps  # rows with a label for every step
        for j, step in enumerate(logits):
            n = T - 2 - j  # rows whose step-j label lies inside the window
            q = step[:, :n].astype(mx.float32)
            ce = -(p_all[:, j : j + n] * nn.log_softmax(q, axis=-1)).sum(axis=-1)
            total = total + weights[j] * ce.mean()
            drafted = mx.argmax(q[:, :shortest], axis=-1)
            drafted = drafted if hot is None else hot[drafted]
            correct.append(drafted == batch.labels[:, 2 + j : 2 + j + shortest])
        hits = mx.stack(correct, axis=-1).astype(mx.float32)  # [N, rows, steps]
        accepted = mx.cumprod(hits, axis=-1).sum(axis=-1).mean()
        acc = hits[..., 0].mean()
        return total / weights.sum(), mx.stop_gradient(acc), mx.stop_gradient(accepted)

    return loss


def save_eagle3(
    head: Eagle3Drafter,
    out: Path,
    config: dict[str, Any],
    card: list[str],
    dtype: mx.Dtype,
    model: nn.Module,
) -> None:
    """speculators' layout: ``config``, the head's weights (``layers.0.*``, ``fc``, ``norm``,
    ``lm_head``, ``input_norm``) with a copy of the target's embedding, and ``d2t``/``t2d``
    when it drafts over a smaller vocabulary; floating tensors cast to ``dtype``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    weights = dict(flat_arrays(head.parameters()))
    if "embed_tokens.weight" not in weights:
        weights["embed_tokens.weight"] = target_head_weights(model)[0]
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}  # fmt: skip
    c = head.config
    if head.target_ids is not None:
        weights["d2t"] = (head.target_ids - mx.arange(c.draft_vocab_size)).astype(mx.int64)
        t2d = mx.zeros((c.vocab_size,), dtype=mx.bool_)
        t2d[head.target_ids] = True
        weights["t2d"] = t2d
    for old in out.glob("model*.safetensors"):  # a smaller re-export must not leave stale shards
        old.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "README.md").write_text("\n".join(card) + "\n")
