"""``dflash-serve train --family dspark``: a DSpark drafter (DeepSpec's recipe, its layout).

The backbone trains as DFlash's does (``train_forward``: K anchors per sequence in one pass), with
DSpark's geometry: the block ``[anchor, mask x (P-1)]`` sits at ``a .. a+P-1`` and row i predicts
the token at ``a+1+i`` ("sample from anchor"; P = block_size - 1 proposals). The Markov head is
teacher-forced on the previous label (row 0's previous token: the anchor), as drafting feeds it
the previous draft, which the target accepted. DeepSpec's loss (``deepspec/modeling/dspark/
loss.py``): ``ce_weight * CE + tv_weight * |p_draft - p_target|_1 + BCE(confidence, acceptance)``,
each weighted ``exp(-i/gamma)`` per row, where the confidence head learns ``1 - TV``, the chance
the draft is accepted under sampling. ``p_target`` comes from the target's final hidden states
through its own head. The embedding and head are the target's, frozen, and saved as copies
(DeepSpec's ``Qwen3DSparkModel`` layout, its keys at the top level).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash_server.drafters.config import OPTIONAL_DEFAULTS
from dflash_server.drafters.dspark import DSparkConfig, DSparkDraftModel
from dflash_server.models.loading import flat_arrays
from dflash_server.models.target_parts import find_target_parts
from dflash_server.tools.common import save_drafter
from dflash_server.tools.train_forward import (
    TrainBatch,
    block_embeddings,
    block_ids,
    block_labels,
    draft_hidden,
    gather_positions,
)
from dflash_server.tools.train_init import (
    fresh_config,
    load_init,
    target_head_weights,
)

LossFn = Callable[[Any, TrainBatch, mx.array], tuple[mx.array, mx.array, mx.array]]
DEFAULT_RANK, DEFAULT_KIND = 256, "vanilla"  # DeepSpec's dspark_qwen3_*.py configs
DEFAULT_CE, DEFAULT_TV = 0.1, 0.9  # its ce_loss_alpha, l1_loss_alpha


def init_dspark(
    args: argparse.Namespace, model: nn.Module, tokenizer: Any, windows: np.ndarray
) -> tuple[DSparkDraftModel, dict[str, Any], str]:
    """(float32 drafter bound to ``model``, its DeepSpec config, the dtype to save in): fresh
    (``--init new``: DeepSpec's shape, sized from the target) or a DSpark folder to fine-tune."""
    if args.init != "new":
        draft, dtype = load_init(args, model, "DSpark")
        if not draft.config.sample_from_anchor:
            raise ValueError(
                f"--init {args.init}: a DSpark drafter without sample_from_anchor; training "
                "implements DeepSpec's geometry (every block position predicts the next token)"
            )
        for own in ("embed_tokens", "lm_head"):  # DeepSpec's copies of the target's: frozen
            if own in draft:
                draft[own].freeze()
        return draft, {**deepspec_config(draft.config), "num_anchors": args.anchors}, dtype
    base = fresh_config(args, model, tokenizer)
    targs = getattr(getattr(model, "language_model", model), "args", None)
    rank = args.markov_rank
    if rank is None:  # DeepSpec's 256, at most the target's width on small targets
        rank = min(DEFAULT_RANK, base["hidden_size"])
    raw = {
        **{k: v for k, v in base.items() if k not in ("architectures", "dflash_config")},
        **base["dflash_config"],
        "architectures": ["Qwen3DSparkModel"],
        "rope_theta": float(getattr(targs, "rope_theta", base["rope_theta"])),  # the target's
        "block_size": base["block_size"] - 1,  # DeepSpec counts proposals
        "markov_rank": rank,
        "markov_head_type": args.markov_kind or DEFAULT_KIND,
        "enable_confidence_head": not args.no_confidence_head,
        "confidence_head_with_markov": rank > 0,
    }
    try:
        draft = DSparkDraftModel(DSparkConfig.from_dict(raw))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad drafter config: {exc}") from None
    # Its output feeds the target's head: start from the target's final-norm gain (train_init).
    draft.norm.weight = find_target_parts(model).backbone.norm.weight.astype(mx.float32)
    draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    draft.train()
    config = {**deepspec_config(draft.config), "num_anchors": args.anchors}  # DeepSpec's key
    return draft.bind(model), config, "float32"


def deepspec_config(config: DSparkConfig) -> dict[str, Any]:
    """The ``config.json`` DeepSpec's trainer writes for ``config`` (``Qwen3DSparkModel``, the
    DSpark keys at the top level, ``block_size`` counting proposals); JSON types only."""
    out = config.to_dict()
    dflash = out.pop("dflash_config")
    for key in ("own_embedding", "own_head", "sample_from_anchor", "architectures"):
        out.pop(key)
    for key, absent in {**OPTIONAL_DEFAULTS, "is_causal": False, "rope_scaling": None,
                        "sliding_window": None, "confidence_threshold": 0.0}.items():  # fmt: skip
        if out.get(key, absent) == absent:
            out.pop(key, None)
    if not config.enable_confidence_head:
        out.pop("confidence_head_with_markov")
    if not config.markov_rank:
        out.pop("markov_head_type")
    return {
        "architectures": ["Qwen3DSparkModel"],
        **out,
        "block_size": config.block_size - 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "target_layer_ids": dflash["target_layer_ids"],
        "mask_token_id": dflash["mask_token_id"],
    }


def dspark_outputs(
    draft: DSparkDraftModel, tokens: mx.array, labels: mx.array, taps: mx.array, anchors: mx.array
) -> tuple[mx.array, mx.array | None]:
    """Logits ``[N, K, P, V]`` of every block row with the Markov bias, teacher-forced on the
    previous label, and the confidence head's logits ``[N, K, P]`` (None without one)."""
    P = draft.config.block_size - 1
    ids = block_ids(tokens, anchors, P, draft.config.mask_token_id)
    h = draft_hidden(draft, block_embeddings(draft, ids), taps, anchors)
    logits = draft.target_head().logits(h)
    anchor = mx.take_along_axis(tokens, anchors, axis=1)[:, :, None]
    previous = mx.concatenate([anchor, block_labels(labels, anchors, P)], axis=-1)
    markov = draft.markov_head
    if markov is not None:
        biases, state = [], None
        for i in range(P):  # row by row, as propose steps it (the rnn kind carries a state)
            bias, state = markov.step(previous[..., i], h[..., i, :], state)
            biases.append(bias)
        logits = logits + mx.stack(biases, axis=2)
    head = draft.confidence_head
    if head is None:
        return logits, None
    features = h
    if draft.config.confidence_head_with_markov and markov is not None:
        features = mx.concatenate([h, markov.markov_w1(previous).astype(h.dtype)], axis=-1)
    return logits, head.proj(features)[..., 0]  # its sigmoid is the predicted acceptance


def make_dspark_loss(args: argparse.Namespace, model: nn.Module) -> LossFn:
    """DeepSpec's weighted CE + L1 (twice the total variation) + confidence BCE, with top-1
    accuracy and the expected accepted drafts per block (greedy) as metrics."""
    lm_head = find_target_parts(model).lm_head
    ce_w = DEFAULT_CE if args.ce_weight is None else args.ce_weight
    tv_w = DEFAULT_TV if args.tv_weight is None else args.tv_weight

    def loss(
        draft: DSparkDraftModel, batch: TrainBatch, weights: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        assert batch.final is not None, "DSpark's loss reads the target's final hidden states"
        P = draft.config.block_size - 1
        logits, confidence = dspark_outputs(
            draft, batch.tokens, batch.labels, batch.taps, batch.anchors
        )
        logits = logits.astype(mx.float32)
        labels = block_labels(batch.labels, batch.anchors, P + 1)  # a+1 .. a+P
        rows = batch.anchors[:, :, None] + mx.arange(P)  # the target's rows predicting them
        target = lm_head(gather_positions(batch.final, rows)).astype(mx.float32)
        l1 = mx.abs(mx.softmax(logits, axis=-1) - mx.softmax(target, axis=-1)).sum(axis=-1)
        norm = weights.sum() * math.prod(l1.shape[:2])

        def mean(x: mx.array) -> mx.array:
            return (x * weights).sum() / norm

        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        total = ce_w * mean(ce) + tv_w * mean(l1)
        if confidence is not None:  # it learns the acceptance chance 1 - TV, not moving it
            accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
            bce = nn.losses.binary_cross_entropy(
                confidence.astype(mx.float32), accept, reduction="none"
            )
            total = total + mean(bce)
        correct = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
        accepted = mx.cumprod(correct, axis=-1).sum(axis=-1).mean()
        return total, mx.stop_gradient(correct.mean()), mx.stop_gradient(accepted)

    return loss


def save_dspark(
    draft: DSparkDraftModel,
    out: Path,
    config: dict[str, Any],
    card: list[str],
    dtype: mx.Dtype,
    model: nn.Module,
) -> None:
    """DeepSpec's layout: ``config``, the drafter's weights with copies of the target's
    embedding and head (as DeepSpec's trainer writes them), floating tensors cast to ``dtype``."""
    export = DSparkDraftModel(dataclasses.replace(draft.config, own_embedding=True, own_head=True))
    weights = flat_arrays(draft.parameters())
    embed, head = target_head_weights(model)
    if not draft.config.own_embedding:
        weights.append(("embed_tokens.weight", embed))
    if not draft.config.own_head:
        weights.append(("lm_head.weight", head))
    export.load_weights(weights, strict=True)
    export.set_dtype(dtype)
    save_drafter(export, out, config, card)
