"""Locate the pieces of an mlx-lm model that DFlash needs, without forking mlx-lm's model code.

mlx-lm models share one shape: an outer ``Model`` (optionally wrapping a ``language_model``) whose
inner ``model`` has ``embed_tokens``, ``layers`` and a final ``norm`` and returns normalised hidden
states; the outer model applies ``lm_head`` (or the tied embedding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass
class TargetParts:
    backbone: nn.Module  # returns final-normed hidden states: backbone(inputs, cache)
    embed_tokens: nn.Module
    lm_head: Callable[[mx.array], mx.array]
    layers: list[nn.Module]
    hidden_size: int
    vocab_size: int
    # Frequencies per axis of multimodal rotary positions (Qwen3.5); None: text positions only.
    mrope_section: tuple[int, ...] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _gathered(head: nn.Module, group: Any) -> Callable[[mx.array], mx.array]:
    """A vocabulary-sharded head whose logits come back whole on every rank (as mlx-lm's own
    forward gathers them), so sampling and the drafter see every token."""
    from mlx_lm.models.base import gather_last_axis

    return lambda hidden: gather_last_axis(head(hidden), group)


def find_target_parts(model: nn.Module) -> TargetParts:
    outer = getattr(model, "language_model", model)
    backbone = getattr(outer, "model", None)
    if backbone is None or not hasattr(backbone, "embed_tokens") or not hasattr(backbone, "layers"):
        raise ValueError(
            f"unsupported target {type(model).__module__}.{type(model).__name__}: expected an "
            "mlx-lm model with model.embed_tokens and model.layers (Qwen3.5, Qwen3, Llama-style)"
        )
    embed = backbone.embed_tokens
    head: Any = outer.get("lm_head") if isinstance(outer, nn.Module) else None
    lm_head = head if head is not None else embed.as_linear
    group = getattr(outer, "sharding_group", None)
    if head is not None and group is not None:  # tensor parallel: each rank holds a vocab slice
        lm_head = _gathered(head, group)
    weight = embed["weight"]
    rows = weight.shape[0]
    # Quantized embeddings pack the hidden dim; the norm's weight always has the true size.
    hidden = backbone.norm.weight.shape[0]
    args = getattr(outer, "args", None)
    rope = getattr(args, "rope_parameters", None) or getattr(args, "rope_scaling", None) or {}
    section = rope.get("mrope_section") if isinstance(rope, dict) else None
    return TargetParts(
        backbone=backbone,
        embed_tokens=embed,
        lm_head=lm_head,
        layers=list(backbone.layers),
        hidden_size=hidden,
        vocab_size=rows,
        mrope_section=tuple(section) if section else None,
    )


def float_bytes(module: Any) -> int:
    """Bytes per element of what a (possibly quantized) layer computes in."""
    weight = module.weight
    dtype = weight.dtype if mx.issubdtype(weight.dtype, mx.floating) else module.scales.dtype
    return int(dtype.size)
